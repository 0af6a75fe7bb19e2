"""Paged KV memory: one preallocated tensor pair, fixed-size blocks, ref counts and byte accounting.

A block is *active* while some request holds a reference, *cached* when unreferenced but indexed by
the prefix cache (kept until its space is needed, then evicted least recently used first), and *free*
otherwise. Byte figures count active + cached blocks: that is the KV the engine really holds.

State held outside blocks (corrections, anchors) is charged to the same budget in whole blocks
(``charge_state``): active + cached + charged blocks never exceed the budget's blocks. Blocks promised
for later (to admitted requests, ``promised``) are not taken by anyone else (``room``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError


class OutOfBlocksError(RuntimeError):
    """No free or evictable block is left."""


@dataclass
class KVStoreStats:
    blocks_total: int
    blocks_active: int
    blocks_cached: int
    block_bytes: int
    peak_blocks: int

    @property
    def kv_bytes(self) -> int:
        return (self.blocks_active + self.blocks_cached) * self.block_bytes

    @property
    def kv_bytes_peak(self) -> int:
        return self.peak_blocks * self.block_bytes


class KVStore:
    """Block-paged K and V tensors shaped [layers, num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 budget_bytes: int, device: torch.device, dtype: torch.dtype,
                 on_evict: Callable[[int], None] | None = None):
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_size = block_size
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * elem
        self.num_blocks = budget_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ConfigError(f"kv_budget_bytes={budget_bytes} is smaller than one block ({self.block_bytes} bytes)")
        shape = (num_layers, self.num_blocks * block_size, num_kv_heads, head_dim)
        # torch.empty does not touch pages on CPU, so an unused budget costs no resident memory.
        try:
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)
        except RuntimeError as exc:      # torch.OutOfMemoryError is one
            self.k = self.v = None
            raise ConfigError(f"kv_budget_bytes={budget_bytes} ({self.num_blocks} blocks) cannot be allocated on "
                              f"{device}: {str(exc).splitlines()[0]}") from None
        self.ref = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached (unreferenced, indexed) blocks
        self._active = 0
        self._peak = 0
        self.state_blocks = 0            # blocks' worth of the budget charged to state held outside blocks
        self.promised = 0                # blocks promised to admitted requests, not yet allocated (the scheduler's)
        self.on_evict = on_evict         # told of each evicted cached block (the prefix cache's index)

    # --- allocation -------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks a request could get now: free ones plus evictable cached ones, less the state's charge."""
        return max(self.num_blocks - self.state_blocks - self._active, 0)

    @property
    def room(self) -> int:
        """Blocks free or evictable that nothing was promised."""
        return self.num_available - self.promised

    def blocks_of(self, nbytes: int) -> int:
        """Whole blocks' worth of ``nbytes``."""
        return -(-nbytes // self.block_bytes)

    def charge_state(self, blocks: int) -> None:
        """Charge ``blocks`` of the budget to state held outside blocks, evicting cached blocks to make room.
        The caller never charges more than the free and cached blocks (``num_available``) allow."""
        assert self._active + blocks <= self.num_blocks, "state charged over blocks in use"
        self.state_blocks = blocks
        while self._active + len(self._lru) + self.state_blocks > self.num_blocks:
            self._evict_cached()

    def _evict_cached(self) -> None:
        block, _ = self._lru.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block)
        self._free.append(block)

    def allocate(self) -> int:
        if self._active + self.state_blocks >= self.num_blocks:
            raise OutOfBlocksError("KV budget exhausted")
        if self._active + len(self._lru) + self.state_blocks >= self.num_blocks:
            self._evict_cached()             # the budget is full: the least recently used cached block goes
        block = self._free.pop()
        self.ref[block] = 1
        self._active += 1
        self._update_peak()
        return block

    def incref(self, block: int) -> None:
        """Take a reference, reviving a cached block if needed."""
        if self.ref[block] == 0:
            self._lru.pop(block)
            self._active += 1
        self.ref[block] += 1

    def decref(self, block: int, cached: bool) -> None:
        """Drop a reference; an unreferenced block stays cached if indexed, else becomes free."""
        assert self.ref[block] > 0, f"block {block} released twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self._active -= 1
            if cached:
                self._lru[block] = None
            else:
                self._free.append(block)

    def uncache(self, block: int) -> None:
        """Drop an unreferenced cached block to the free list (e.g. when the cache is cleared)."""
        if block in self._lru:
            del self._lru[block]
            self._free.append(block)

    def touch(self, block: int) -> None:
        if block in self._lru:
            self._lru.move_to_end(block)

    def _update_peak(self) -> None:
        held = self._active + len(self._lru)
        if held > self._peak:
            self._peak = held

    def reset_peak(self) -> None:
        self._peak = self._active + len(self._lru)

    # --- data ------------------------------------------------------------------------------
    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices for token positions [start, end) of a sequence with these blocks."""
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.k.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def stats(self) -> KVStoreStats:
        return KVStoreStats(self.num_blocks, self._active, len(self._lru), self.block_bytes, self._peak)
