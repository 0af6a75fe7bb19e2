"""Server-sent events for streamed chat completions, and cancelling work whose client went away.

A request's KV is freed only when its engine stream is closed, so both paths close it as soon as the
client disconnects instead of waiting for the next write to fail.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..chat.tool_stream import ToolCallStreamer, ToolDelta
from ..engine import RequestOutput, StreamDelta
from .errors import from_exception
from .protocol import chunk_json, finish_reason, logprobs_json, usage_json

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


async def aclose(stream: AsyncIterator) -> None:
    """Close a backend stream (which aborts its request if it has not finished); a no-op once finished."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float) -> T:
    """Await ``work``; cancel it (which aborts its engine request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task


class SSEResponse(StreamingResponse):
    """A StreamingResponse that stops and closes its body as soon as the client disconnects;
    ``on_close`` runs when it is done either way."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def listen(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listen, tg.cancel_scope)
                with suppress(OSError):            # the client went away between two writes
                    await self.stream_response(send)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()      # closes the engine stream: aborts and frees KV
            if self._on_close is not None:
                self._on_close()                   # the body already accounted a finished request


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def tool_delta_json(d: ToolDelta) -> dict:
    """OpenAI's streamed tool call: the first delta names the call, later ones carry argument text."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


async def sse_chunks(first: StreamDelta, rest: AsyncIterator[StreamDelta], *, cid: str, model: str,
                     created: int, tool_names: set[str] | None, include_usage: bool,
                     on_output: Callable[[RequestOutput], None], on_error: Callable[[int], None],
                     max_tool_calls: int | None = None) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events for a stream whose first delta has arrived, then ``[DONE]``.

    With tools, the model's tool-call blocks never reach the content: each call streams as OpenAI's
    ``tool_calls`` deltas while it is generated (chat/tool_stream.py says how a cut call stays invalid).
    """
    tools = ToolCallStreamer(tool_names, max_tool_calls) if tool_names else None

    def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None,
              logprobs: dict | None = None) -> str:
        return _event(chunk_json(cid, model, created, delta, finish, usage, with_usage=include_usage,
                                 logprobs=logprobs))

    try:
        yield chunk({"role": "assistant", "content": ""})
        delta: StreamDelta | None = first
        while delta is not None:
            text, calls = tools.push(delta.text) if tools else (delta.text, [])
            out = delta.output
            if out is not None and tools:
                more_text, more_calls = tools.finish(out.tool_calls)
                text, calls = text + more_text, calls + more_calls
            if text or delta.logprobs:
                yield chunk({"content": text}, logprobs=logprobs_json(delta.logprobs))
            for call in calls:
                yield chunk({"tool_calls": [tool_delta_json(call)]})
            if out is not None:
                yield chunk({}, finish_reason(out))
                if include_usage:
                    yield chunk(None, usage=usage_json(out))
                on_output(out)
                break
            delta = await anext(rest, None)
        yield DONE
    except Exception as exc:          # headers are sent: the error travels as an event
        err = from_exception(exc)
        on_error(err.status)
        yield _event(err.body())
        yield DONE
    finally:
        await aclose(rest)
