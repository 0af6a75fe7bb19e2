"""Streamed model text split into content and tool-call deltas, as OpenAI streams tool calls.

A ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` block of a known tool yields a first delta
with the call's index, id and name (no arguments), then the arguments' JSON text in fragments as it is
generated. The arguments' final ``}`` is held back until the whole block parses (with the same parser
as the non-streaming reply) to exactly that call: a block cut by max_tokens, or invalid, leaves the
client arguments that are never valid JSON, so it never becomes a valid call. Blocks of another shape
(``parameters``, a list, an OpenAI-shaped call) are sent whole when they close.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable

from .tool_filter import _partial_tag_len
from .tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, new_call_id, parse_tool_calls

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_ARGS_SEEN = re.compile(r'"(arguments|parameters)"\s*:\s*\S')
_HEAD_LIMIT = 400          # a block whose head is not the streamable shape by then is sent whole


@dataclass
class ToolDelta:
    """One tool-call delta: the first of a call has ``id`` and ``name``; later ones argument text only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class ToolCallStreamer:
    """Feed streamed text with ``push``; ``finish`` once the request is done. Both return
    (content to show, tool-call deltas). ``max_calls`` caps the calls started (1 for
    ``parallel_tool_calls=false``); blocks past it are hidden."""

    def __init__(self, tool_names: Iterable[str], max_calls: int | None = None):
        self._names = set(tool_names)
        self._max = max_calls
        self._pending = ""                 # text not yet handled (outside: a possible partial open tag)
        self._block: str | None = None     # inside a block: its body so far
        self._mode = ""
        self._started = 0
        self._seen_block = False
        self._deltas: list[ToolDelta] = []
        self.completed: list[ToolCall] = []

    # --- public ------------------------------------------------------------------------------
    def push(self, text: str) -> tuple[str, list[ToolDelta]]:
        self._pending += text
        return self._run(final=False)

    def finish(self, final_calls: list[ToolCall]) -> tuple[str, list[ToolDelta]]:
        """Flush; ``final_calls`` (the reply's parsed calls) are sent when no block was seen (a reply
        that is a bare JSON call)."""
        shown, deltas = self._run(final=True)
        if self._block is None:
            shown += self._pending
            self._pending = ""
        elif self._mode != "done":
            self._advance(self._block, closed=False, final=True)
        if not self._seen_block:
            for call in final_calls:
                self._whole(call)
        return shown, deltas + self._take()

    # --- the machine ---------------------------------------------------------------------------
    def _run(self, final: bool) -> tuple[str, list[ToolDelta]]:
        shown: list[str] = []
        while True:
            if self._block is None:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    hold = 0 if final else _partial_tag_len(self._pending, TOOL_CALL_OPEN)
                    shown.append(self._pending[:len(self._pending) - hold])
                    self._pending = self._pending[len(self._pending) - hold:]
                    break
                shown.append(self._pending[:start])
                self._block, self._pending = "", self._pending[start + len(TOOL_CALL_OPEN):]
                self._mode, self._seen_block = "head", True
            self._block += self._pending
            self._pending = ""
            end = self._block.find(TOOL_CALL_CLOSE)
            if end < 0:
                self._advance(self._block, closed=False, final=False)
                break
            body, self._pending = self._block[:end], self._block[end + len(TOOL_CALL_CLOSE):]
            self._advance(body, closed=True, final=False)
            self._block = None
        return "".join(shown), self._take()

    def _advance(self, body: str, closed: bool, final: bool) -> None:
        done = closed or final
        if self._mode == "head":
            m = _HEAD.match(body)
            if m is None and not (done or _ARGS_SEEN.search(body) or len(body) > _HEAD_LIMIT):
                return                                   # the head may still come
            self._mode = "buffer"
            if self._max is not None and self._started >= self._max:
                self._mode = "done"                      # past the cap: hidden
            elif m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = None
                if name in self._names:
                    self._start_call(name, m.end())
        if self._mode == "args":
            self._scan(body, len(body) if done else len(body) - _partial_tag_len(body, TOOL_CALL_CLOSE))
            if done and self._mode == "args":
                self._mode = "done"                      # cut inside the arguments: never completed
        if self._mode == "tail" and done:
            self._verify(body, closed)
        if self._mode == "buffer" and done:
            self._mode = "done"
            for call in parse_tool_calls(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""),
                                         self._names).tool_calls:
                self._whole(call)

    def _start_call(self, name: str, args_start: int) -> None:
        self._index, self._name = self._started, name
        self._started += 1
        self._deltas.append(ToolDelta(self._index, "", new_call_id(), name))
        self._mode, self._pos, self._sent, self._args_start = "args", args_start, args_start, args_start
        self._depth, self._in_str, self._esc = 0, False, False

    def _scan(self, body: str, limit: int) -> None:
        """Track the arguments object's nesting; send its text as it comes, all but its closing brace."""
        while self._pos < limit:
            ch = body[self._pos]
            self._pos += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_end = self._pos
                    self._send(body[self._sent:self._pos - 1])
                    self._sent = self._pos - 1
                    self._mode = "tail"
                    return
        self._send(body[self._sent:self._pos])
        self._sent = self._pos

    def _verify(self, body: str, closed: bool) -> None:
        """Send the held ``}`` only when the block parses to exactly the call streamed."""
        self._mode = "done"
        parsed = parse_tool_calls(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""), self._names)
        try:
            args = json.loads(body[self._args_start:self._args_end])
        except json.JSONDecodeError:
            return
        if len(parsed.tool_calls) == 1 and not parsed.invalid_tool_calls:
            call = parsed.tool_calls[0]
            if call.name == self._name and call.arguments == args:
                self._send(body[self._sent:self._args_end])
                self.completed.append(call)

    def _whole(self, call: ToolCall) -> None:
        if self._max is not None and self._started >= self._max:
            return
        self._index = self._started
        self._started += 1
        self._deltas.append(ToolDelta(self._index, "", call.id, call.name))
        self._send(json.dumps(call.arguments, ensure_ascii=False))
        self.completed.append(call)

    def _send(self, text: str) -> None:
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._index and last.id is None:
            last.arguments += text                       # one fragment per push
        else:
            self._deltas.append(ToolDelta(self._index, text))

    def _take(self) -> list[ToolDelta]:
        out, self._deltas = self._deltas, []
        return out
