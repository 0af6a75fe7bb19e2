"""PrefixCache: exact full-block matching per namespace, references, eviction and clearing."""
from __future__ import annotations

import torch

from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.cache.prefix_cache import PrefixCache, PrefixIndex

BS = 4


def make(num_blocks: int = 8) -> tuple[KVStore, PrefixCache]:
    block_bytes = 2 * 1 * BS * 1 * 2 * 4
    index = PrefixIndex()
    store = KVStore(1, 1, 2, BS, num_blocks * block_bytes, torch.device("cpu"), torch.float32, index.forget)
    return store, PrefixCache(store, index)


def computed_sequence(store: KVStore, cache: PrefixCache, ns: str, ids: list[int],
                      release: bool = True) -> list[int]:
    """Allocate blocks for ids, index its full blocks, and (optionally) release them as a finished request."""
    blocks = [store.allocate() for _ in range(-(-len(ids) // BS))]
    cache.insert(ns, ids, blocks, 0, len(ids) // BS, 0)
    if release:
        for b in blocks:
            store.decref(b, cached=cache.is_cached(b))
    return blocks


PROMPT = list(range(100, 114))          # 14 tokens: 3 full blocks + 2 spare tokens


def test_match_after_insert_returns_blocks_and_refs_them():
    store, cache = make()
    blocks = computed_sequence(store, cache, "a", PROMPT)
    assert [cache.is_cached(b) for b in blocks] == [True, True, True, False]
    assert store.stats().blocks_cached == 3 and store.stats().blocks_active == 0

    got, parent = cache.match("a", PROMPT, len(PROMPT))
    assert got == blocks[:3]
    assert all(store.ref[b] == 1 for b in got)
    assert store.stats().blocks_active == 3 and store.stats().blocks_cached == 0
    # The returned hash resumes the chain: indexing block 3 from it equals indexing it from scratch.
    assert parent == cache.chain(cache.chain(cache.chain(0, "a", tuple(PROMPT[0:4])), "a", tuple(PROMPT[4:8])),
                                 "a", tuple(PROMPT[8:12]))

    again, _ = cache.match("a", PROMPT, len(PROMPT))       # a second reader shares the blocks
    assert again == got and all(store.ref[b] == 2 for b in got)


def test_match_on_empty_cache_and_short_inputs():
    store, cache = make()
    assert cache.match("a", PROMPT, len(PROMPT)) == ([], 0)
    computed_sequence(store, cache, "a", PROMPT)
    assert cache.match("a", PROMPT[:3], 3) == ([], 0)      # shorter than one block
    assert cache.match("a", PROMPT, 0) == ([], 0)
    assert store.stats().blocks_active == 0


def test_namespaces_isolate_agents():
    store, cache = make()
    computed_sequence(store, cache, "agent-a", PROMPT)
    assert cache.match("agent-b", PROMPT, len(PROMPT)) == ([], 0)
    assert store.stats().blocks_active == 0
    blocks_b = computed_sequence(store, cache, "agent-b", PROMPT)
    got_a, _ = cache.match("agent-a", PROMPT, len(PROMPT))
    got_b, _ = cache.match("agent-b", PROMPT, len(PROMPT))
    assert len(got_a) == len(got_b) == 3
    assert not set(got_a) & set(got_b) and got_b == blocks_b[:3]


def test_mismatch_in_the_middle_stops_the_match():
    store, cache = make()
    blocks = computed_sequence(store, cache, "a", PROMPT)
    changed = list(PROMPT)
    changed[5] = 999                                      # inside block 1
    got, _ = cache.match("a", changed, len(changed))
    assert got == blocks[:1]
    # Block 2's tokens are identical, but its chain (what came before) differs, so it is not matched.
    tail_only = [0, 0, 0, 0] + PROMPT[4:]
    assert cache.match("a", tail_only, len(tail_only))[0] == []


def test_match_never_covers_more_than_max_tokens():
    store, cache = make()
    blocks = computed_sequence(store, cache, "a", PROMPT[:12])    # exactly 3 full blocks
    for max_tokens, expect in [(12, 3), (11, 2), (8, 2), (7, 1), (4, 1), (3, 0)]:
        got, _ = cache.match("a", PROMPT[:12], max_tokens)
        assert got == blocks[:expect], max_tokens
        assert len(got) * BS <= max_tokens
        for b in got:
            store.decref(b, cached=True)
    # The scheduler's "leave one token to run" call: a prompt of exactly the cached length.
    got, _ = cache.match("a", PROMPT[:12], 12 - 1)
    assert len(got) * BS < 12


def test_eviction_removes_block_from_index():
    store, cache = make(num_blocks=4)
    blocks = computed_sequence(store, cache, "a", PROMPT[:12])     # 3 cached, 1 free
    store.touch(blocks[0])                                         # LRU order now: 1, 2, 0
    fresh = [store.allocate(), store.allocate()]                   # free block, then evicts block 1
    assert blocks[1] in fresh and not cache.is_cached(blocks[1])
    assert cache.is_cached(blocks[0]) and cache.is_cached(blocks[2])
    got, _ = cache.match("a", PROMPT[:12], 12)
    assert got == blocks[:1]                                       # chain broken at the evicted block
    # A later insert of different tokens into the reused block cannot resurrect the old entry.
    other = [7] * 8
    cache.insert("a", other, [fresh[0], fresh[1]], 0, 2, 0)
    for b in got:
        store.decref(b, cached=True)
    assert cache.match("a", PROMPT[:12], 12)[0] == blocks[:1]
    assert cache.match("a", other, 8)[0] == fresh


def test_identical_twin_blocks_are_not_double_indexed():
    store, cache = make()
    first = computed_sequence(store, cache, "a", PROMPT[:8], release=False)
    twin = computed_sequence(store, cache, "a", PROMPT[:8], release=False)   # computed concurrently
    assert all(cache.is_cached(b) for b in first)
    assert not any(cache.is_cached(b) for b in twin)
    for b in first + twin:
        store.decref(b, cached=cache.is_cached(b))
    s = store.stats()
    assert (s.blocks_active, s.blocks_cached) == (0, 2)              # twins went back to the free list
    assert cache.match("a", PROMPT[:8], 8)[0] == first


def test_insert_resumes_from_parent_and_skips_already_indexed():
    store, cache = make()
    ids = PROMPT[:12]
    blocks = [store.allocate() for _ in range(3)]
    h1 = cache.insert("a", ids, blocks, 0, 1, 0)
    h3 = cache.insert("a", ids, blocks, 1, 3, h1)                    # incremental indexing
    again = cache.insert("a", ids, blocks, 0, 3, 0)                  # re-indexing is a no-op
    assert h3 == again
    for b in blocks:
        store.decref(b, cached=cache.is_cached(b))
    got, parent = cache.match("a", ids, 12)
    assert got == blocks and parent == h3


def test_clear_frees_cached_blocks_and_forgets_active_ones():
    store, cache = make()
    cached = computed_sequence(store, cache, "a", PROMPT[:8])
    live = computed_sequence(store, cache, "b", PROMPT[:8], release=False)
    assert store.stats().blocks_cached == 2 and store.stats().blocks_active == 2
    cache.clear()
    s = store.stats()
    assert (s.blocks_active, s.blocks_cached) == (2, 0)
    assert store.num_available == store.num_blocks - 2
    assert not any(cache.is_cached(b) for b in cached + live)
    assert cache.match("a", PROMPT[:8], 8) == ([], 0)
    for b in live:                                                   # released after the clear: freed
        store.decref(b, cached=cache.is_cached(b))
    assert store.stats().blocks_cached == 0 and store.num_available == store.num_blocks
