"""What the HTTP gateway talks to: one embedded engine (LocalBackend) or engine replicas (serve/ray_backend.py).

The app never touches an ``Engine`` directly, so scale-out is a different backend, not a different app.
``session`` names a workflow (LangGraph thread_id, AutoGen team id, or a header): every request and edge
declaration of one session must reach the same engine, so its agents share their history's KV.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Protocol

from ..engine import Engine, SamplingParams, StreamDelta


class Backend(Protocol):
    """The engine operations the gateway needs."""

    model_name: str
    max_context: int

    def stream(self, messages: list[dict], *, agent: str, sampling: SamplingParams,
               tools: list[dict] | None = None, tool_choice: Any = None, session: str | None = None,
               request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Engine.stream on the engine serving ``session``; leaving the loop early aborts the request."""
        ...

    async def set_edges(self, edges: Iterable[tuple[str, str]], session: str | None = None) -> None:
        """Declare a workflow's edge order on the engine serving ``session``."""
        ...

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        ...

    async def stats(self) -> dict[str, Any]:
        """Engine.stats() of a single engine; with replicas, ``{"replicas": [...], ...}`` (see its backend)."""
        ...

    async def aclose(self) -> None:
        ...


class LocalBackend:
    """One engine in this process; every session shares it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_context = engine.max_context

    def stream(self, messages: list[dict], *, agent: str, sampling: SamplingParams,
               tools: list[dict] | None = None, tool_choice: Any = None, session: str | None = None,
               request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        return self.engine.stream(messages, agent, sampling, tools, tool_choice, request_id)

    async def set_edges(self, edges: Iterable[tuple[str, str]], session: str | None = None) -> None:
        self.engine.set_edges(edges)

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return self.engine.count_tokens(messages, tools)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def aclose(self) -> None:
        await self.engine.aclose()
