"""Streamed text without the model's tool-call blocks, for every adapter and the HTTP gateway."""
from __future__ import annotations

from .tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class ToolBlockFilter:
    """Hides ``<tool_call>...</tool_call>`` blocks from streamed text.

    Text that might be the start of an opening tag is held back until the next push, so streamed
    content matches the non-streaming ``content`` (tool calls arrive on the final chunk instead).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False

    def push(self, text: str) -> str:
        """Add streamed text; return what can be shown now."""
        self._buf += text
        shown: list[str] = []
        while True:
            if self._inside:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    self._buf = self._buf[-(len(TOOL_CALL_CLOSE) - 1):]   # a close tag may straddle pushes
                    break
                self._buf = self._buf[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
            else:
                start = self._buf.find(TOOL_CALL_OPEN)
                if start < 0:
                    hold = _partial_tag_len(self._buf, TOOL_CALL_OPEN)
                    shown.append(self._buf[:len(self._buf) - hold])
                    self._buf = self._buf[len(self._buf) - hold:]
                    break
                shown.append(self._buf[:start])
                self._buf = self._buf[start + len(TOOL_CALL_OPEN):]
                self._inside = True
        return "".join(shown)

    def flush(self) -> str:
        """Return any held-back text that turned out not to be a tag."""
        text = "" if self._inside else self._buf
        self._buf = ""
        return text


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
