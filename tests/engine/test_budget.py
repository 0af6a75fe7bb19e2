"""KVBudget (engine/budget.py): state charged in whole blocks next to the promises, shed least recently
used first, reclaimed for admission before home views, and the peak of blocks and state together."""
from __future__ import annotations

import torch

from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.engine.budget import KVBudget

BS = 4
BLOCK = 2 * 1 * BS * 1 * 2 * 4          # bytes of one block (1 layer, 1 head, head_dim 2, fp32)


class Holder:
    """State in pieces of bytes, least recently used first; the last ``pinned`` are read by requests."""

    def __init__(self, *pieces: int, pinned: int = 0):
        self.pieces, self.pinned = list(pieces), pinned

    def state_bytes(self) -> int:
        return sum(self.pieces)

    def shed_state(self) -> bool:
        if len(self.pieces) > self.pinned:
            self.pieces.pop(0)
            return True
        return False


def make(num_blocks: int, *holders: Holder, homes: int = 0) -> tuple[KVStore, KVBudget, list[int]]:
    store = KVStore(1, 1, 2, BS, num_blocks * BLOCK, torch.device("cpu"), torch.float32)
    evicted: list[int] = []

    def evict_home() -> bool:
        if len(evicted) < homes:
            evicted.append(len(evicted))
            return True
        return False
    budget = KVBudget(store, {f"m{i}": h for i, h in enumerate(holders)}, evict_home)
    return store, budget, evicted


def test_state_is_charged_in_whole_blocks_and_evicts_cached_blocks():
    holder = Holder()
    store, budget, _ = make(4, holder)
    blocks = [store.allocate() for _ in range(4)]
    for b in blocks:
        store.decref(b, cached=True)                # 4 cached blocks fill the store
    holder.pieces = [BLOCK + 1]                     # a block and a byte: two blocks' worth
    budget.charge_state()
    assert store.state_blocks == 2 and store.stats().blocks_cached == 2
    assert store.num_available == 2 and budget.state_over_budget == 0
    holder.pieces = []
    budget.charge_state()
    assert store.state_blocks == 0 and store.num_available == 4


def test_state_over_the_promises_is_shed_oldest_first_and_what_is_read_stays_uncharged():
    old, read = Holder(BLOCK, BLOCK, pinned=0), Holder(2 * BLOCK, pinned=1)
    store, budget, _ = make(4, old, read)
    store.promised = 1                              # 3 blocks left for state: 4 blocks' worth held
    budget.charge_state()
    assert old.pieces == [BLOCK] and read.pieces == [2 * BLOCK]    # one piece of old state went
    assert store.state_blocks == 3 and budget.state_over_budget == 0
    store.promised = 3                              # only 1 block left: old goes, the read state cannot
    budget.charge_state()
    assert old.pieces == [] and read.pieces == [2 * BLOCK]
    assert store.state_blocks == 1 and budget.state_over_budget == BLOCK
    store.promised = 0
    budget.charge_state()                           # the report keeps the most that did not fit
    assert store.state_blocks == 2 and budget.state_over_budget == BLOCK


def test_reclaim_sheds_state_before_home_views_then_gives_up():
    holder = Holder(BLOCK, BLOCK)
    store, budget, evicted = make(4, holder, homes=1)
    budget.charge_state()
    assert store.room == 2
    assert budget.reclaim() and holder.pieces == [BLOCK] and evicted == []
    assert store.state_blocks == 1 and store.room == 3           # re-charged at once
    assert budget.reclaim() and holder.pieces == [] and store.room == 4
    assert budget.reclaim() and evicted == [0]                   # then one home view
    assert not budget.reclaim()                                  # nothing left to go


def test_peak_counts_blocks_and_state_together_until_reset():
    holder = Holder(100)
    store, budget, _ = make(4, holder)
    a, b = store.allocate(), store.allocate()
    budget.track_peak()
    assert budget.peak_total == 2 * BLOCK + 100 and budget.state_bytes() == 100
    store.decref(a, cached=False)
    store.decref(b, cached=False)
    holder.pieces = []
    budget.track_peak()
    assert budget.peak_total == 2 * BLOCK + 100                  # a peak, not the level
    budget.reset_peak()
    assert budget.peak_total == 0 and store.stats().peak_blocks == 0
    budget.track_peak()
    assert budget.peak_total == 0
