"""One engine replica: the Ray actor class that holds an ``Engine`` (imported only inside Ray workers
and by ``ray_backend.py``; this module itself needs no Ray)."""
from __future__ import annotations

import os
from typing import Any, AsyncIterator, Iterable

from ..engine import Engine, EngineConfig, SamplingParams, StreamDelta


class EngineReplica:
    """An engine in a Ray worker process. Async methods, so Ray runs it as an async actor: many
    requests stream at once and a cancelled stream is an ``asyncio`` cancellation that aborts it."""

    def __init__(self, config: EngineConfig, index: int):
        self.index = index
        self.engine = Engine(config)

    async def info(self) -> dict[str, Any]:
        return {"replica": self.index, "model_name": self.engine.model_name,
                "max_context": self.engine.max_context, "pid": os.getpid(),
                "package": __file__}

    async def stream(self, messages: list[dict], agent: str, sampling: SamplingParams,
                     tools: list[dict] | None, tool_choice: Any,
                     request_id: str | None) -> AsyncIterator[StreamDelta]:
        deltas = self.engine.stream(messages, agent, sampling, tools, tool_choice, request_id)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()         # however Ray stops us (cancel, caller gone): abort, free the KV

    async def set_edges(self, edges: Iterable[tuple[str, str]]) -> None:
        self.engine.set_edges(edges)

    async def count_tokens(self, messages: list[dict], tools: list[dict] | None) -> int:
        return self.engine.count_tokens(messages, tools)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def aclose(self) -> None:
        await self.engine.aclose()
