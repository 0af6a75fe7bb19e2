"""A token's raw bytes and display text, for logprobs (a token may hold part of a UTF-8 character)."""
from __future__ import annotations

import re
import threading
from typing import Any

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")     # sentencepiece byte-fallback tokens


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's scheme: printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), computed once per id. ``text`` shows bytes that are not a whole
    character as ``\\xNN`` escapes; ``bytes`` are exact."""

    def __init__(self, tokenizer: Any, lock: threading.Lock | None = None):
        self._tok, self._lock = tokenizer, lock or threading.Lock()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            with self._lock:
                piece = self._tok.convert_ids_to_tokens(int(token_id))
                raw = self._raw(piece, token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return hit

    def _raw(self, piece: Any, token_id: int) -> bytes:
        if isinstance(piece, str):
            if m := _HEX_BYTE.match(piece):
                return bytes([int(m.group(1), 16)])
            if piece and all(ch in _BYTE_LEVEL for ch in piece):
                return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return self._tok.decode([int(token_id)]).encode("utf-8")
