"""The KV budget: ``kv_budget_bytes`` as the store's blocks, shared by requests' own KV (promised to them
at admission), cached prefix blocks, home views, and the state reuse methods hold outside blocks
(corrections, anchors), charged in whole blocks. ``KVBudget`` keeps it: it charges that state, sheds it,
reclaims room for admission, and records the peak (docs/reliability.md, "What the budget bounds").
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol

from ..cache.kv_store import KVStore


class StateHolder(Protocol):
    """What holds state outside blocks (a reuse method)."""

    def state_bytes(self) -> int: ...
    def shed_state(self) -> bool: ...


class KVBudget:
    """One budget for blocks and the state held outside them; runs on the worker thread."""

    def __init__(self, store: KVStore, holders: Mapping[str, StateHolder], evict_home: Callable[[], bool]):
        self.store = store
        self.holders = holders           # the reuse methods by name
        self.evict_home = evict_home     # drops the least recently used unpinned home view; False when none can go
        self.peak_total = 0              # most bytes of blocks and state held at once (``reset_peak``)
        self.state_over_budget = 0       # most bytes of state that could not be charged (in use by requests)

    def state_bytes(self) -> int:
        return sum(h.state_bytes() for h in self.holders.values())

    def charge_state(self) -> None:
        """Charge the state held outside blocks (corrections, anchors) to the KV budget: cached blocks are
        evicted for it, and while it would take blocks promised to running requests, the least recently
        used state is dropped. State that running requests read cannot go; what of it does not fit is
        left uncharged and reported (``state_over_budget_bytes``)."""
        store = self.store
        while True:
            state = self.state_bytes()
            limit = store.num_blocks - store.stats().blocks_active - store.promised
            if store.blocks_of(state) <= limit or not self.shed_state():
                break
        charged = min(store.blocks_of(state), max(limit, 0))
        store.charge_state(charged)
        self.state_over_budget = max(self.state_over_budget, state - charged * store.block_bytes)

    def shed_state(self) -> bool:
        """Drop one holder's least recently used piece of state; False when none can go."""
        return any(h.shed_state() for h in self.holders.values())

    def reclaim(self) -> bool:
        """Free budget for admission: drop the least recently used state (then re-charge it), else the least
        recently used unpinned home view; False when neither can go."""
        if self.shed_state():
            self.charge_state()
            return True
        return self.evict_home()

    def track_peak(self) -> None:
        """Sample the bytes held now (blocks and state) into the peak."""
        total = self.store.stats().kv_bytes + self.state_bytes()
        if total > self.peak_total:
            self.peak_total = total

    def reset_peak(self) -> None:
        """Restart peak accounting (blocks and totals) from the current level."""
        self.store.reset_peak()
        self.peak_total = 0
