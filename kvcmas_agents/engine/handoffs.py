"""The agent edge order learned from traffic, for engines nobody told it (``Engine.set_edges``)."""
from __future__ import annotations


class HandOffs:
    """Learns ``(a, b)`` when agent b's request arrives with nothing in flight and a's finished last.

    That is a hand-off in a pipeline or a round robin; requests that overlap (fan-outs) teach nothing.
    Runs on the worker thread; ``edges`` is replaced whole, so other threads read a consistent list.
    """

    def __init__(self) -> None:
        self.edges: list[tuple[str, str]] = []
        self._in_flight = 0
        self._last: str | None = None

    def arrived(self, agent: str) -> None:
        """A real request of ``agent`` was submitted."""
        edge = (self._last, agent)
        if self._in_flight == 0 and self._last not in (None, agent) and edge not in self.edges:
            self.edges = [*self.edges, edge]   # type: ignore[list-item]  # _last is a str here
        self._in_flight += 1

    def finished(self, agent: str, completed: bool) -> None:
        """A real request of ``agent`` ended; only a completed one hands off."""
        self._in_flight -= 1
        if completed:
            self._last = agent
