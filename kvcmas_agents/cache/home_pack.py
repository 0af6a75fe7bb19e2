"""Packing of home views' partial blocks.

A home view keeps the KV blocks its tokens sit in. Segments rarely align with blocks: a 3-token
role trailer would hold a whole 16-slot block, and every message's first and last blocks are shared
with text no home keeps (a request's generation prompt, a reused span's unwritten slots). So a home
keeps in place only the blocks its tokens fill whole; the tokens in its partial edge blocks are copied
(every layer, K and V) into *pack* blocks that home views fill one after another. Once the request
that computed them ends, the partial blocks go back to the free list, and home views hold about
one block per block_size of their tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from .kv_store import KVStore


class HomePacker:
    def __init__(self, store: KVStore, can_allocate: Callable[[], bool] | None = None):
        self.store = store
        self._open: int | None = None     # the pack block being filled
        self._used = 0                    # slots of it taken
        self._fresh: set[int] = set()    # pack blocks allocated during the current place()
        self.copied_tokens = 0
        # Whether one more block may be taken now: by default one nothing was promised (to running requests).
        self.can_allocate: Callable[[], bool] = can_allocate or (lambda: store.room > 0)

    def place(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, list[int]]:
        """Slots for positions [start, end) of a sequence with these blocks, and the blocks to hold
        for them, one reference each taken here. Whole blocks stay in place; partial ones are packed
        (or, when no block can be taken, held as they are)."""
        bs = self.store.block_size
        slots = self.store.slots(blocks, start, end)
        held: list[int] = []
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs) - start, min(end, (i + 1) * bs) - start
            packed = self._copy(slots[lo:hi]) if hi - lo < bs else None
            if packed is None:           # a whole block, or no room for a pack block: hold it in place
                if blocks[i] not in held:
                    held.append(blocks[i])
                continue
            slots[lo:hi] = packed
            for b in (int(x) for x in (packed // bs).unique()):
                if b not in held:
                    held.append(b)
        fresh, self._fresh = self._fresh, set()    # allocated here: their reference is already taken
        for b in held:
            if b not in fresh:
                self.store.incref(b)
        return slots, held

    def _copy(self, src: torch.Tensor) -> torch.Tensor | None:
        """Copy the KV at ``src`` into pack blocks (filling the open one, then a new one) and return
        the new slots, or None when a block is needed and none may be taken."""
        n, bs = src.numel(), self.store.block_size
        free = 0 if self._open is None else bs - self._used
        if n > free and not self.can_allocate():
            return None
        parts, left = [], n
        while left:                              # n < bs: the open block's rest, then at most one more
            if self._open is None or self._used == bs:
                self._open, self._used = self.store.allocate(), 0
                self._fresh.add(self._open)      # allocated with the reference its first home takes
            take = min(left, bs - self._used)
            parts.append(torch.arange(self._used, self._used + take, device=src.device) + self._open * bs)
            self._used += take
            left -= take
        dst = torch.cat(parts)
        for cache in (self.store.k, self.store.v):
            cache.index_copy_(1, dst, cache.index_select(1, src))
        self.copied_tokens += n
        return dst

    def released(self, block: int) -> None:
        """A block's references are gone: stop filling it if it was the open one."""
        if block == self._open and self.store.ref[block] == 0:
            self._open, self._used = None, 0
