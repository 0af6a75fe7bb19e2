"""Incremental detokenization with stop-string handling for streamed generation."""
from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decode context so the first generated token decodes as it would mid-text.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Streams text for generated token ids, holding back incomplete UTF-8 and possible stop-string prefixes.

    Each step decodes only a short window ``ids[prefix_offset:]`` and emits what it adds over
    ``ids[prefix_offset:read_offset]``, so a generation of n tokens costs O(n) decode work.

    Attributes:
        text: all text emitted so far (the concatenation of every ``push``/``finish`` return).
        stopped: True once a stop string appeared; ``text`` then ends right before it.
        matched_stop: the stop string that ended the text, else None.
    """

    def __init__(self, tokenizer: Any, stop: list[str], prompt_ids: list[int] | None = None):
        self._tok = tokenizer
        self._stops = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        ctx = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        # A context ending mid-character would garble the first generated characters.
        if ctx and self._decode(ctx).endswith(_REPLACEMENT):
            ctx = []
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._decoded = ""  # every complete character decoded so far, including held-back text
        self._finished = False
        self.text = ""
        self.stopped = False
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became safe to emit (may be "")."""
        if self.stopped or self._finished:
            return ""
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or the last character's bytes are still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._advance(window[len(prefix):], final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of generation (never past a stop string)."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        return self._advance(window[len(prefix):], final=True)

    def _advance(self, new: str, final: bool) -> str:
        """Append decoded text, check stop strings, and emit everything that is safe."""
        start = max(0, len(self._decoded) - self._max_stop + 1)
        self._decoded += new
        cut = self._find_stop(start)
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(self._decoded)
        else:
            end = len(self._decoded) - self._held_tail()
        delta = self._decoded[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta

    def _find_stop(self, start: int) -> int | None:
        """Index of the earliest stop string beginning at or after ``start``, if any."""
        best: tuple[int, int] | None = None
        for s in self._stops:
            i = self._decoded.find(s, start)
            if i >= 0 and (best is None or (i, len(s)) < best):
                best = (i, len(s))
                self.matched_stop = s
        return None if best is None else best[0]

    def _held_tail(self) -> int:
        """Length of the longest tail of the decoded text that is a proper prefix of a stop."""
        held = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(self._decoded)), held, -1):
                if self._decoded.endswith(s[:n]):
                    held = n
                    break
        return held
