"""Deliver worker events to callers: onto an asyncio loop, or into a thread-safe queue."""
from __future__ import annotations

import asyncio
import queue
from typing import Any


class LoopSink:
    """Posts events to an asyncio.Queue owned by the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def __call__(self, event: Any) -> None:
        # Raises RuntimeError once the caller's loop is closed; the worker then drops the request.
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self) -> Any:
        return await self.queue.get()


class ThreadSink:
    """Posts events to a queue.Queue for synchronous callers."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()

    def __call__(self, event: Any) -> None:
        self.queue.put(event)

    def get(self, timeout: float | None = None) -> Any:
        """The next event; queue.Empty after ``timeout`` seconds without one."""
        return self.queue.get(timeout=timeout)
