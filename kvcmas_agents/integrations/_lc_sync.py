"""Drive async iterators from synchronous code on one shared background event loop."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()
_ITEM, _ERROR, _END = "item", "error", "end"


def background_loop() -> asyncio.AbstractEventLoop:
    """The process-wide helper loop (a daemon thread), started on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="kvcmas-sync-bridge", daemon=True).start()
        return _loop


def iterate_sync(make_iter: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """Iterate ``make_iter()`` from any thread; leaving early cancels the async side."""
    items: queue.Queue[tuple[str, object]] = queue.Queue()

    async def pump() -> None:
        try:
            async for item in make_iter():
                items.put((_ITEM, item))
        except BaseException as exc:    # includes cancellation: the consumer may still be waiting
            items.put((_ERROR, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        items.put((_END, None))

    future = asyncio.run_coroutine_threadsafe(pump(), background_loop())
    try:
        while True:
            kind, value = items.get()
            if kind == _ITEM:
                yield value  # type: ignore[misc]
            elif kind == _ERROR:
                raise value  # type: ignore[misc]
            else:
                return
    finally:
        future.cancel()     # no-op once finished; otherwise aborts the engine request
