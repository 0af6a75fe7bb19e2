"""Admission, KV block bookkeeping and step planning (continuous batching with chunked prefill).

Each step mixes one decode token per running request with prompt chunks, under a token budget.
A request is admitted only when the blocks for its whole prompt and max_tokens can be promised,
so decode never runs out of KV and nothing needs preemption.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..cache.kv_store import KVStore
from ..cache.prefix_cache import PrefixCache
from ..errors import EngineError
from ..reuse.base import ReuseMethod
from .config import EngineConfig
from .request import Request


@dataclass
class StepItem:
    request: Request
    num_tokens: int          # new tokens fed this step, starting at request.num_computed

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, store: KVStore, prefix: PrefixCache,
                 method_of: Callable[[Request], ReuseMethod], reclaim: Callable[[], bool] = lambda: False):
        self.config = config
        self.store = store
        self.prefix = prefix
        self.method_of = method_of     # the reuse method serving a request
        self.reclaim = reclaim         # frees budget (LRU state, then home views); False when nothing can go
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._promised = 0           # reserved-but-unallocated blocks over running requests
        self.budget_fallbacks = 0    # requests admitted as exact prefills because their reuse did not fit
        self.reject: Callable[[Request, Exception], None] = lambda req, exc: None   # fails a request (the worker)
        self.fell_back: Callable[[Request, Exception], None] = lambda req, exc: None   # its plan raised (the worker)

    # --- lifecycle ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.store.block_size)

    def add(self, req: Request) -> None:
        if req.options.reuse is None:
            req.options = req.options.resolve(self.config)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        """Move waiting requests to running, FIFO, while their KV can be promised.

        A request that does not fit waits while others run (they free KV as they finish). With nothing
        running, waiting would never end: the views its plan reuses are pinned for it and may be what
        fills the budget. It is then planned again as an exact prefill, with every home view evictable;
        if even that cannot fit, it fails (``reject``) instead of waiting forever."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            self.plan(req)
            need = self._fit(req)
            if need > self.room:
                self._unplan(req)
                if self.running:
                    return
                req.exact_fallback = True
                need = self._fit(req)
                if need > self.room:
                    self.waiting.popleft()
                    self._unplan(req)
                    self.reject(req, EngineError(
                        f"request {req.request_id} needs {need} KV blocks but only {self.room} of "
                        f"{self.store.num_blocks} can be freed with nothing else running"))
                    continue
                if req.fallback is None:          # (a request requeued by a failure counts there)
                    self.budget_fallbacks += 1
                    req.fallback = "budget"
            self.waiting.popleft()
            if req.admitted_at is None:
                req.admitted_at = time.perf_counter()
                req.timings.add("queue", req.admitted_at - req.arrival)
            req.reserved_blocks = need
            self._promised += need
            self.running.append(req)

    def _fit(self, req: Request) -> int:
        """Blocks the planned request still needs, after reclaiming budget (unread state, unpinned home views)."""
        need = self._own_blocks(req, req.max_total_tokens) - len(req.blocks)
        while need > self.room and self.reclaim():
            pass
        return need

    def requeue_exact(self, req: Request) -> None:
        """Send a running request back to the head of the queue as an exact prefill: its KV, promises and
        reuse pins are released and its plan forgotten, so it is admitted again with nothing reused and
        prefills its prompt (and the tokens it already produced, which stay its output)."""
        if req in self.running:
            self.running.remove(req)
        self._unplan(req)
        req.recomputed_tokens = req.indexed_blocks = req.index_parent = 0
        req.registered, req.select_from, req.view_base = False, None, None
        req.exact_fallback = True
        self.waiting.appendleft(req)

    def _unplan(self, req: Request) -> None:
        self.release(req)
        req.num_computed = req.cached_tokens = req.reused_tokens = req.own_prefix_end = req.reuse_end = 0

    # --- side requests (work ahead of time, e.g. KVCMAS's prefetch) ------------------------------
    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Promise and allocate the blocks a planned request owns for num_tokens; False (nothing taken)
        when they do not fit next to what running requests were promised."""
        need = self._own_blocks(req, num_tokens) - len(req.blocks)
        if need > self.room:
            return False
        req.reserved_blocks += need
        self._promised += need
        self.ensure_blocks(req, num_tokens)
        return True

    def take_blocks(self, n: int) -> list[int] | None:
        """``n`` blocks for a running request beyond what it was promised, when they fit next to every
        promise (evicting unreferenced cached blocks if need be); else None and nothing taken."""
        if n > self.room:
            return None
        return [self.store.allocate() for _ in range(n)]

    @property
    def promised(self) -> int:
        """Blocks promised to running requests and not yet allocated."""
        return self._promised

    @property
    def room(self) -> int:
        """Blocks free or evictable that no running request was promised."""
        return self.store.num_available - self._promised

    def _own_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks a request must own to hold num_tokens (reused spans need none)."""
        bs = self.store.block_size
        return sum(1 for i in range(self.blocks_for(num_tokens)) if not req.is_hole(i * bs, (i + 1) * bs))

    def plan(self, req: Request) -> None:
        """Give the request KV it need not compute, before its prefill: its reuse method's plan. A
        prompt whose template is not prefix-stable, or that fell back for the budget, is prefilled whole."""
        if req.prompt.prefix_stable and not req.exact_fallback:
            try:
                with req.timings.phase("plan"):
                    self.method_of(req).plan(req)
            except Exception as exc:      # an optimization failed: the request is prefilled exactly
                self._unplan(req)
                req.exact_fallback = True
                self.fell_back(req, exc)

    def finish(self, req: Request) -> None:
        """Release a request's KV (running or waiting); cached blocks stay indexed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """Free a request's blocks, promises and pins (finish() and side requests)."""
        for b in req.blocks:
            if b >= 0:
                self.store.decref(b, cached=self.prefix.is_cached(b))
        req.blocks = []
        self.method_of(req).release(req)
        self._promised -= req.reserved_blocks
        req.reserved_blocks = 0

    # --- steps ---------------------------------------------------------------------------------
    def schedule(self) -> list[StepItem]:
        """Plan one step: decodes first, then prompt chunks, within max_batch_tokens."""
        self.admit()
        budget = self.config.max_batch_tokens
        items: list[StepItem] = []
        for req in self.running:
            if not req.in_prefill and budget > 0:
                # One sampled token, or with it the tokens its grammar forced (engine/jump.py), in one chunk.
                n = min(req.num_tokens - req.num_computed, budget)
                items.append(StepItem(req, n))
                budget -= n
        for req in self.running:
            if req.in_prefill and budget > 0 and not req.needs_correction:
                end = req.own_prefix_end if req.num_computed < req.own_prefix_end else len(req.prompt_ids)
                n = min(end - req.num_computed, budget)
                items.append(StepItem(req, n))
                budget -= n
        for item in items:
            self.ensure_blocks(item.request, item.request.num_computed + item.num_tokens)
        return items

    def ensure_blocks(self, req: Request, num_tokens: int) -> None:
        bs = self.store.block_size
        while len(req.blocks) < self.blocks_for(num_tokens):
            i = len(req.blocks)
            if req.is_hole(i * bs, (i + 1) * bs):
                req.blocks.append(-1)          # wholly inside a reused span: no own KV there
                continue
            req.blocks.append(self.store.allocate())
            req.reserved_blocks -= 1
            self._promised -= 1

    def committed(self, item: StepItem) -> None:
        """Record that the step's tokens now have KV, and tell the request's reuse method."""
        item.request.num_computed += item.num_tokens
        self.method_of(item.request).on_computed(item.request)
