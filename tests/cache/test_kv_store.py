"""KVStore: block states, LRU eviction, byte accounting, slot mapping and writes."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.cache.kv_store import KVStore, OutOfBlocksError
from kvcmas_agents.errors import ConfigError

LAYERS, KVH, HD, BS = 2, 2, 4, 4
BLOCK_BYTES = 2 * LAYERS * BS * KVH * HD * 4          # fp32


def make_store(num_blocks: int = 4, dtype: torch.dtype = torch.float32, extra_bytes: int = 0,
               on_evict=None) -> KVStore:
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * LAYERS * BS * KVH * HD * elem
    return KVStore(LAYERS, KVH, HD, BS, num_blocks * block_bytes + extra_bytes, torch.device("cpu"), dtype,
                   on_evict)


def state(store: KVStore) -> tuple[int, int, int]:
    s = store.stats()
    return s.blocks_active, s.blocks_cached, store.num_available


def test_geometry_and_budget_rounding():
    store = make_store(4, extra_bytes=BLOCK_BYTES - 1)       # a partial block is not a block
    assert store.block_bytes == BLOCK_BYTES
    assert store.num_blocks == 4
    assert store.k.shape == store.v.shape == (LAYERS, 4 * BS, KVH, HD)
    half = make_store(3, dtype=torch.bfloat16)
    assert half.block_bytes == BLOCK_BYTES // 2 and half.num_blocks == 3
    assert half.k.dtype == torch.bfloat16


def test_budget_smaller_than_one_block_raises():
    with pytest.raises(ValueError, match="smaller than one block"):
        KVStore(LAYERS, KVH, HD, BS, BLOCK_BYTES - 1, torch.device("cpu"), torch.float32)
    KVStore(LAYERS, KVH, HD, BS, BLOCK_BYTES, torch.device("cpu"), torch.float32)   # exactly one is fine


def test_budget_that_cannot_be_allocated_raises_config_error():
    with pytest.raises(ConfigError, match="cannot be allocated"):
        KVStore(LAYERS, KVH, HD, BS, 10**15, torch.device("cpu"), torch.float32)     # a petabyte


def test_allocate_incref_decref_transitions():
    store = make_store(4)
    assert state(store) == (0, 0, 4)
    a = store.allocate()
    b = store.allocate()
    assert a != b and store.ref[a] == store.ref[b] == 1
    assert state(store) == (2, 0, 2)

    store.incref(a)                               # shared by a second holder
    assert store.ref[a] == 2 and state(store) == (2, 0, 2)
    store.decref(a, cached=True)                  # still referenced: stays active regardless of flag
    assert store.ref[a] == 1 and state(store) == (2, 0, 2)

    store.decref(a, cached=True)                  # unreferenced + indexed -> cached
    assert store.ref[a] == 0 and state(store) == (1, 1, 3)
    store.incref(a)                               # revive a cached block
    assert store.ref[a] == 1 and state(store) == (2, 0, 2)
    store.decref(a, cached=True)
    store.uncache(a)                              # cached -> free
    assert state(store) == (1, 0, 3)
    store.uncache(a)                              # idempotent on a free block
    assert state(store) == (1, 0, 3)

    store.decref(b, cached=False)                 # unreferenced + not indexed -> free
    assert state(store) == (0, 0, 4)
    with pytest.raises(AssertionError):
        store.decref(b, cached=False)             # released twice


def test_uncache_ignores_active_blocks():
    store = make_store(2)
    a = store.allocate()
    store.uncache(a)
    assert store.ref[a] == 1 and state(store) == (1, 0, 1)


def test_free_blocks_are_used_before_evicting_cached_ones():
    evicted: list[int] = []
    store = make_store(3, on_evict=evicted.append)
    a = store.allocate()
    store.decref(a, cached=True)
    b, c = store.allocate(), store.allocate()
    assert a not in (b, c) and evicted == []
    assert state(store) == (2, 1, 1)


def test_lru_eviction_order_and_callback():
    evicted: list[int] = []
    store = make_store(4, on_evict=evicted.append)
    blocks = [store.allocate() for _ in range(4)]
    for blk in blocks:                            # cached in order 0, 1, 2, 3 (0 least recent)
        store.decref(blk, cached=True)
    assert state(store) == (0, 4, 4)
    store.touch(blocks[0])                        # 0 becomes most recently used
    store.incref(blocks[1])                       # 1 is revived: active, not evictable
    store.decref(blocks[1], cached=True)          # ...and re-cached as most recent
    order = [store.allocate() for _ in range(4)]
    assert order == [blocks[2], blocks[3], blocks[0], blocks[1]]
    assert evicted == order
    assert state(store) == (4, 0, 0)
    with pytest.raises(OutOfBlocksError):
        store.allocate()
    assert evicted == order                       # a failed allocation evicts nothing


def test_touch_ignores_active_and_free_blocks():
    store = make_store(2)
    a = store.allocate()
    store.touch(a)                                # active: no-op, must not enter the LRU
    assert state(store) == (1, 0, 1)
    store.decref(a, cached=False)
    store.touch(a)                                # free: no-op
    assert state(store) == (0, 0, 2)


def test_out_of_blocks_when_nothing_evictable():
    store = make_store(2)
    store.allocate()
    store.allocate()
    assert store.num_available == 0
    with pytest.raises(OutOfBlocksError):
        store.allocate()
    assert state(store) == (2, 0, 0)


def test_byte_accounting_and_peak():
    store = make_store(3)
    s = store.stats()
    assert (s.blocks_total, s.kv_bytes, s.kv_bytes_peak, s.block_bytes) == (3, 0, 0, BLOCK_BYTES)
    a, b, c = store.allocate(), store.allocate(), store.allocate()
    s = store.stats()
    assert s.kv_bytes == 3 * BLOCK_BYTES and s.kv_bytes_peak == 3 * BLOCK_BYTES

    store.decref(a, cached=True)                  # cached KV still counts as held
    store.decref(b, cached=False)                 # freed KV does not
    s = store.stats()
    assert (s.blocks_active, s.blocks_cached) == (1, 1)
    assert s.kv_bytes == (s.blocks_active + s.blocks_cached) * s.block_bytes == 2 * BLOCK_BYTES
    assert s.peak_blocks == 3                     # peak remembers the high-water mark

    store.reset_peak()
    assert store.stats().kv_bytes_peak == 2 * BLOCK_BYTES
    d = store.allocate()                          # takes the free block, not the cached one
    assert d == b and store.stats().peak_blocks == 3
    e = store.allocate()                          # evicts a: held count stays 3
    assert e == a and store.stats().peak_blocks == 3 and store.stats().blocks_cached == 0
    for blk in (c, d, e):
        store.decref(blk, cached=False)
    assert store.stats().kv_bytes == 0 and store.stats().kv_bytes_peak == 3 * BLOCK_BYTES
    store.reset_peak()
    assert store.stats().kv_bytes_peak == 0


def test_slots_span_blocks():
    store = make_store(8)
    blocks = [5, 2, 7]
    slots = store.slots(blocks, 0, 10)
    assert slots.dtype == torch.long
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    assert store.slots(blocks, 3, 9).tolist() == [23, 8, 9, 10, 11, 28]
    assert store.slots(blocks, 4, 4).tolist() == []
    assert store.slots([1], 0, 4).tolist() == [4, 5, 6, 7]


def test_write_lands_in_the_mapped_slots():
    store = make_store(4)
    blocks = [3, 0]
    slots = store.slots(blocks, 2, 6)              # two tokens in block 3, two in block 0
    k = torch.arange(4 * KVH * HD, dtype=torch.float32).view(4, KVH, HD)
    store.write(1, slots, k, -k)
    assert torch.equal(store.k[1, 14], k[0]) and torch.equal(store.k[1, 15], k[1])
    assert torch.equal(store.k[1, 0], k[2]) and torch.equal(store.k[1, 1], k[3])
    assert torch.equal(store.v[1, slots], -k)
    gathered = store.k[1][store.slots(blocks, 2, 6)]
    assert torch.equal(gathered, k)


def test_state_charge_takes_cached_blocks_first_and_bounds_allocation():
    store = make_store(4)
    a, b, c = store.allocate(), store.allocate(), store.allocate()
    store.decref(b, cached=True)
    store.decref(c, cached=True)                  # 1 active, 2 cached, 1 free
    store.charge_state(2)                         # 2 blocks' worth of state: one cached block must go
    assert state(store) == (1, 1, 1) and store.num_available == 1
    assert store.stats().blocks_active + store.stats().blocks_cached + store.state_blocks <= store.num_blocks
    store.allocate()                              # the last block the budget allows (evicting the cached one)
    assert state(store) == (2, 0, 0)
    with pytest.raises(OutOfBlocksError):
        store.allocate()
    store.charge_state(0)
    assert store.num_available == 2 and store.blocks_of(store.block_bytes + 1) == 2
