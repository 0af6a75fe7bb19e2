"""The agent pipeline's edge order, shared by the engine (callers) and its reuse methods (the worker)
without either holding the other: the registered edges, else the hand-offs learned from traffic."""
from __future__ import annotations

from typing import Iterable

from ..errors import InvalidRequestError
from .handoffs import HandOffs


class EdgeOrder:
    """(predecessor, successor) pairs in registration order; replaced whole by ``set``. While none are
    registered, the learned hand-offs (``learned``, engine/handoffs.py) stand in."""

    def __init__(self, learned: HandOffs | None = None) -> None:
        self.edges: list[tuple[str, str]] = []
        self.learned = learned

    def set(self, edges: Iterable[tuple[str, str]]) -> None:
        clean = []
        for edge in edges:
            if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(a, str) and a for a in edge)):
                raise InvalidRequestError(f"edges must be (source, target) pairs of agent names, got {edge!r}")
            clean.append((edge[0], edge[1]))
        self.edges = clean         # replaced whole: readers see the old list or the new one

    def active(self) -> list[tuple[str, str]]:
        """The registered edges, else the learned ones."""
        return self.edges or (self.learned.edges if self.learned is not None else [])

    def predecessors(self, agent: str) -> list[str]:
        """Agents with an edge into ``agent``, in registration (else learning) order."""
        return [a for a, b in self.active() if b == agent]

    def successors(self, agent: str) -> list[str]:
        """Agents with an edge from ``agent``, in registration (else learning) order."""
        return [b for a, b in self.active() if a == agent and b != agent]
