"""The agent pipeline's registered edge order, shared by the engine (callers) and its reuse methods
(the worker) without either holding the other."""
from __future__ import annotations

from typing import Iterable

from ..errors import InvalidRequestError


class EdgeOrder:
    """(predecessor, successor) pairs in registration order; replaced whole by ``set``."""

    def __init__(self) -> None:
        self.edges: list[tuple[str, str]] = []

    def set(self, edges: Iterable[tuple[str, str]]) -> None:
        clean = []
        for edge in edges:
            if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(a, str) and a for a in edge)):
                raise InvalidRequestError(f"edges must be (source, target) pairs of agent names, got {edge!r}")
            clean.append((edge[0], edge[1]))
        self.edges = clean         # replaced whole: readers see the old list or the new one

    def predecessors(self, agent: str) -> list[str]:
        """Agents with an edge into ``agent``, in registration order."""
        return [a for a, b in self.edges if b == agent]

    def successors(self, agent: str) -> list[str]:
        """Agents with an edge from ``agent``, in registration order."""
        return [b for a, b in self.edges if a == agent and b != agent]
