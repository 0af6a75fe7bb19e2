"""Exact prefix cache: full KV blocks indexed by a chained hash of (namespace, token ids).

The namespace is the agent for ``reuse="prefix"`` (per-agent caching, as non-shared serving does
it). Each entry also keeps its tokens, so a hash collision can never hand out wrong KV.

The index is built before the store, which tells it of each cached block it evicts:

    index = PrefixIndex()
    store = KVStore(..., on_evict=index.forget)
    cache = PrefixCache(store, index)
"""
from __future__ import annotations

from .kv_store import KVStore


class PrefixIndex:
    """Indexed full blocks: by chained hash, and each block's (hash, tokens)."""

    def __init__(self) -> None:
        self.by_hash: dict[int, int] = {}
        self.entry: dict[int, tuple[int, tuple[int, ...]]] = {}   # block -> (hash, tokens)

    def forget(self, block: int) -> None:
        """The block's KV is gone (evicted, or the cache cleared): drop its entry."""
        entry = self.entry.pop(block, None)
        if entry is not None:
            self.by_hash.pop(entry[0], None)


class PrefixCache:
    def __init__(self, store: KVStore, index: PrefixIndex):
        # A store that does not tell this index of evictions would let it hand out reused blocks.
        assert store.on_evict == index.forget, "build the store with on_evict=index.forget"
        self.store = store
        self.index = index

    @staticmethod
    def chain(parent: int, namespace: str, tokens: tuple[int, ...]) -> int:
        return hash((parent, namespace, tokens))

    def is_cached(self, block: int) -> bool:
        return block in self.index.entry

    def match(self, namespace: str, token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """Longest run of cached full blocks covering a prefix of token_ids, at most max_tokens long.

        Returns the blocks, referenced for the caller (who must release them), and the chained hash
        after them (to resume indexing from).
        """
        bs = self.store.block_size
        blocks: list[int] = []
        parent = 0
        for start in range(0, max_tokens - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            h = self.chain(parent, namespace, tokens)
            block = self.index.by_hash.get(h)
            if block is None or self.index.entry[block][1] != tokens:
                break
            blocks.append(block)
            parent = h
        for block in blocks:
            self.store.incref(block)
            self.store.touch(block)
        return blocks, parent

    def insert(self, namespace: str, token_ids: list[int], blocks: list[int],
               start_block: int, end_block: int, parent: int) -> int:
        """Index full blocks [start_block, end_block) of a sequence whose KV is computed.

        parent is the chained hash of the blocks before start_block; returns the hash after end_block.
        """
        bs = self.store.block_size
        for i in range(start_block, end_block):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = self.chain(parent, namespace, tokens)
            block = blocks[i]
            if block in self.index.entry or parent in self.index.by_hash:
                continue    # already indexed (this block, or an identical twin)
            self.index.by_hash[parent] = block
            self.index.entry[block] = (parent, tokens)
        return parent

    def clear(self) -> None:
        """Drop every index entry; unreferenced cached blocks become free."""
        for block in list(self.index.entry):
            self.index.forget(block)
            self.store.uncache(block)
