"""Admission, planning, preparation and step planning (continuous batching with chunked prefill), and
when work off the critical path runs; requests' blocks and promises are kept by ``blocks.py``.

Each step mixes one decode token per running request with prompt chunks, under a token budget.
A request is admitted only when the blocks for its whole prompt and max_tokens can be promised,
so decode never runs out of KV and nothing needs preemption. A request whose reuse fails (its plan,
its correction) is served as an exact prefill instead; one that can never be served is handed back
to the worker to fail (``take_failed``).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import EngineError
from ..reuse.base import ReuseMethod
from ..reuse.plan import EMPTY_PLAN
from .blocks import RequestBlocks
from .budget import KVBudget
from .config import EngineConfig
from .request import Request
from .stats import Counters

log = logging.getLogger("kvcmas_agents.engine")


@dataclass
class StepItem:
    request: Request
    num_tokens: int          # new tokens fed this step, starting at request.num_computed

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: RequestBlocks, methods: Mapping[str, ReuseMethod],
                 budget: KVBudget, counters: Counters):
        self.config = config
        self.blocks = blocks           # requests' blocks and promises
        self.store = blocks.store
        self.methods = methods         # the reuse methods by name
        self.budget = budget           # charges state, reclaims room (LRU state, then home views)
        self.counters = counters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.budget_fallbacks = 0    # requests admitted as exact prefills because their reuse did not fit
        self._failed: list[tuple[Request, BaseException]] = []   # for the worker to fail (``take_failed``)

    def method_of(self, req: Request) -> ReuseMethod:
        """The reuse method serving a request."""
        return self.methods[req.options.reuse]

    # --- lifecycle ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.options.reuse is None:
            req.options = req.options.resolve(self.config)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_failed(self) -> list[tuple[Request, BaseException]]:
        """Requests that can never be served (e.g. too large for the budget with nothing else running),
        with their errors, since the last call: removed from the queue, for the worker to fail."""
        failed, self._failed = self._failed, []
        return failed

    def admit(self) -> None:
        """Move waiting requests to running, FIFO, while their KV can be promised.

        A request that does not fit waits while others run (they free KV as they finish). With nothing
        running, waiting would never end: the views its plan reuses are pinned for it and may be what
        fills the budget. It is then planned again as an exact prefill, with every home view evictable;
        if even that cannot fit, it fails (``take_failed``) instead of waiting forever."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            self.plan(req)
            need = self._fit(req)
            if need > self.blocks.room:
                self._unplan(req)
                if self.running:
                    return
                req.exact_fallback = True
                need = self._fit(req)
                if need > self.blocks.room:
                    self.waiting.popleft()
                    self._unplan(req)
                    self._failed.append((req, EngineError(
                        f"request {req.request_id} needs {need} KV blocks but only {self.blocks.room} of "
                        f"{self.store.num_blocks} can be freed with nothing else running")))
                    continue
                if req.fallback is None:          # (a request requeued by a failure counts there)
                    self.budget_fallbacks += 1
                    req.fallback = "budget"
            self.waiting.popleft()
            if req.admitted_at is None:
                req.admitted_at = time.perf_counter()
                req.timings.add("queue", req.admitted_at - req.arrival)
            self.blocks.promise(req, need)
            self.running.append(req)

    def _fit(self, req: Request) -> int:
        """Blocks the planned request still needs, after reclaiming budget (unread state, unpinned home views)."""
        need = self.blocks.own_blocks(req, req.max_total_tokens) - len(req.blocks)
        while need > self.blocks.room and self.budget.reclaim():
            pass
        return need

    def requeue_exact(self, req: Request) -> None:
        """Send a running request back to the head of the queue as an exact prefill: its KV, promises and
        reuse pins are released and its plan forgotten, so it is admitted again with nothing reused and
        prefills its prompt (and the tokens it already produced, which stay its output)."""
        if req in self.running:
            self.running.remove(req)
        self._unplan(req)
        req.recomputed_tokens = 0
        req.exact_fallback = True
        self.waiting.appendleft(req)

    def _unplan(self, req: Request) -> None:
        """Undo a plan: what it took is released (its method drops its state of the request) and the
        request is laid out as if it reused nothing."""
        self.release(req)
        self.blocks.apply_plan(req, EMPTY_PLAN)

    def plan(self, req: Request) -> None:
        """Give the request KV it need not compute, before its prefill: its reuse method's plan. A
        prompt whose template is not prefix-stable, or that fell back for the budget, is prefilled whole."""
        if req.prompt.prefix_stable and not req.exact_fallback:
            try:
                with req.timings.phase("plan"):
                    self.blocks.apply_plan(req, self.method_of(req).plan(req))
            except Exception as exc:      # an optimization failed: the request is prefilled exactly
                self._unplan(req)
                req.exact_fallback = True
                self._record_fallback(req, "plan", exc)

    def finish(self, req: Request) -> None:
        """Release a request's KV (running or waiting); cached blocks stay indexed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """Free a request's blocks and promises, and let its reuse method let go of it (pins, state)."""
        self.blocks.free(req)
        self.method_of(req).release(req)

    # --- steps ---------------------------------------------------------------------------------
    def schedule(self) -> list[StepItem]:
        """One step's work: admit waiting requests (after their agents' queued work), prepare the running
        ones (at most one correction), charge the state that made to the budget, and plan the step."""
        self._admitting()
        self.admit()
        self._prepare_one()
        self.budget.charge_state()
        items = self._plan()
        # Peak: this step's blocks and fresh corrections, before the step retires anything (a step only
        # writes into blocks planned here; idle work samples its own).
        self.budget.track_peak()
        return items

    def _plan(self) -> list[StepItem]:
        """Decodes first, then prompt chunks, within max_batch_tokens; their blocks allocated."""
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
            self.blocks.ensure(item.request, item.request.num_computed + item.num_tokens)
        return items

    def committed(self, item: StepItem) -> None:
        """Record that the step's tokens now have KV, and tell the request's reuse method."""
        item.request.num_computed += item.num_tokens
        self.method_of(item.request).on_computed(item.request)

    # --- preparation and fallbacks -------------------------------------------------------------
    def _prepare_one(self) -> None:
        """Let the reuse methods prepare the running requests whose own prefix is computed: at most one
        with real work (a correction) per step, the oldest first, so concurrent requests keep prefilling
        and decoding between corrections; requests with nothing to compute pass at once."""
        busy = False
        for req in list(self.running):
            if req.finish_reason is None and req.needs_correction:
                method = self.method_of(req)
                work = method.pending(req)
                if work and busy:
                    continue
                busy = busy or work
                try:
                    self.blocks.ensure(req, len(req.prompt_ids))
                    with req.timings.phase("correct"):
                        method.prepare(req)
                    req.num_computed = req.reuse_end
                except Exception as exc:
                    error = self.fall_back(req, "correction", exc)
                    if error is not None:
                        self._failed.append((req, error))

    def fall_back(self, req: Request, where: str, exc: BaseException) -> EngineError | None:
        """A request whose reuse failed (its correction, or a step over its reused view) is served again as
        an exact prefill of its prompt and of the tokens it already produced, which stay its output; the
        failure is logged once and counted (``counters.reuse_fallbacks``), and its output says
        ``reuse="none"`` and why (``RequestOutput.fallback``). A request with nothing to fall back from
        (already exact, or aborted) is left as it is: the error to fail it with is returned."""
        if req.exact_fallback or req.aborted:
            return EngineError(f"{where} failed for {req.request_id}: {exc!r}")
        self._record_fallback(req, where, exc)
        self.requeue_exact(req)
        return None

    def _record_fallback(self, req: Request, where: str, exc: BaseException) -> None:
        req.fallback = f"{where} failed: {exc!r}"
        self.counters.add("reuse_fallbacks")
        log.warning("kvcmas: %s's %s failed under reuse=%r; served as an exact prefill instead: %r",
                    req.request_id, where, req.options.reuse, exc)

    # --- work off the critical path (ahead-of-time corrections) ----------------------------------
    def _admitting(self) -> None:
        """Work queued for the waiting requests' agents runs before they are admitted (e.g. their own
        ahead-of-time corrections), so what they reuse does not depend on timing; they wait for it."""
        waiting = list(self.waiting)
        t0 = time.perf_counter()
        for m in self.methods.values():
            self._off_path(m, m.admitting, {r.agent for r in waiting})
        dt = time.perf_counter() - t0
        if dt > 1e-4:
            for r in waiting:
                r.timings.add("ahead", dt)

    def idle(self) -> bool:
        """Work off the critical path runs only while nothing waits and nobody is prefilling (e.g.
        during decode), so it never delays a first token; a decode step waits for one unit at most.
        Returns whether the worker should come back without sleeping (a method had work, or it did
        not ask them: then the worker has requests anyway)."""
        if self.waiting or any(r.in_prefill for r in self.running):
            return True
        busy = {r.agent for r in self.running}
        for m in self.methods.values():
            if self._off_path(m, m.idle, busy):
                self.budget.charge_state()
                self.budget.track_peak()
                return True
        return False

    def _off_path(self, method: ReuseMethod, work: Any, agents: set[str]) -> Any:
        """Work off the critical path (ahead-of-time corrections) is an optimization: when it raises, the
        method's queued work is dropped (the requests correct inline) and counted, and the worker goes on."""
        try:
            return work(agents)
        except Exception as exc:
            self.counters.add("idle_work_failed")
            log.warning("kvcmas: %s's work ahead of time failed and was dropped: %r", method.name, exc)
            method.drop_idle_work()
            return True                       # it ran (and may have left state to charge)
