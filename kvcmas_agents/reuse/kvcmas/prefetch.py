"""Ahead-of-time corrections along the edge order: the edge order's real job is scheduling.

When agent Y's prompt has been computed, each graph successor S of Y will most likely next see
``[S's own system prefix] + [Y's shared messages] + [Y's reply, a hand-off] + [generation prompt]``.
Everything but Y's reply is known now, and the generation prompt is the same for every agent. So while
Y decodes, the worker builds that predicted prompt for S and runs the normal KVCMAS correction on it
(selection by the generation prompt's attention, selective recompute, compression). The corrections
are stored under S's name and S's exact token context, so S's real request uses them only when its
prompt really has the same tokens before each segment; anything else is corrected inline as usual.
S's time to first token then pays only for its newest segments and its suffix.

A prefetch runs only when no real request is waiting or prefilling, or right before S's own real
request is admitted (so the result does not depend on timing). Failures drop the prefetch, never a
request.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from ...chat.template import RenderedPrompt, Segment
from ..base import ReuseContext, ReuseRequest
from ..options import ReuseOptions
from ..plan import ReusePlan
from ..request_view import RequestView


SELECT_WINDOW = 32


@dataclass
class _Prefix:
    """An agent's own leading system segments, from its latest request."""

    ids: list[int]
    segments: list[Segment]


@dataclass
class _Prediction:
    """A successor's predicted request, and where its selection queries start (a stand-in tail)."""

    req: ReuseRequest
    select_from: int


@dataclass
class PrefetchStats:
    queued: int = 0
    corrections: int = 0          # prefetches that computed at least one correction
    recomputed_tokens: int = 0
    seconds: float = 0.0
    skipped: int = 0              # nothing to correct, prefix unknown, or no KV room
    failed: int = 0
    by_agent: dict[str, int] = field(default_factory=dict)


def _leading_prefix(req: ReuseRequest) -> int:
    """End of the request's leading "prefix" segments (its own system message)."""
    end = 0
    for seg in req.prompt.segments:
        if seg.kind != "prefix":
            break
        end = seg.end
    return end


class Prefetcher:
    """Queues and runs a KVCMAS method's ahead-of-time corrections, one pending per agent.

    Each predicted side request is planned (``plan``: the method's), seen as a ``RequestView``
    (``view_of``: its plan, with the predicted selection queries), corrected (``correct``) and let go
    of (``release``): the prefetcher needs no more of the method than these.
    """

    def __init__(self, ctx: ReuseContext, plan: Callable[[ReuseRequest], ReusePlan],
                 view_of: Callable[[ReuseRequest, int], RequestView], correct: Callable[[RequestView], None],
                 release: Callable[[ReuseRequest], None], ratio: float = 0.0):
        self.ctx, self.plan, self.view_of, self.correct, self.release = ctx, plan, view_of, correct, release
        self._prefixes: dict[str, _Prefix] = {}
        self._queue: OrderedDict[str, _Prediction] = OrderedDict()     # one pending prefetch per agent
        self.stats = PrefetchStats()
        self.ratio = ratio            # floor on the recompute ratio of ahead-of-time corrections

    def has_work(self) -> bool:
        return bool(self._queue)

    def observe(self, req: ReuseRequest) -> None:
        """A kvcmas request's prompt is computed: remember its agent's prefix, queue its successors."""
        if not req.prompt.prefix_stable:
            return
        end = _leading_prefix(req)
        if end == 0 or req.prompt.segments[-1].kind != "suffix":
            return
        self._prefixes[req.agent] = _Prefix(req.prompt_ids[:end], [s for s in req.prompt.segments if s.end <= end])
        if req.declare:        # a declared prefix alone: nothing shared to predict from
            return
        for succ in self.ctx.successors(req.agent):
            spec = self._predict(succ, req, end)
            if spec is not None:
                self._queue.pop(succ, None)
                self._queue[succ] = spec
                self.stats.queued += 1

    def _predict(self, agent: str, src: ReuseRequest, src_prefix_end: int) -> _Prediction | None:
        prefix = self._prefixes.get(agent)
        if prefix is None or agent == src.agent:
            return None
        shift = len(prefix.ids) - src_prefix_end
        ids = prefix.ids + src.prompt_ids[src_prefix_end:]
        segments = list(prefix.segments) + [replace(s, start=s.start + shift, end=s.end + shift)
                                            for s in src.prompt.segments if s.start >= src_prefix_end]
        prompt = RenderedPrompt(ids, segments, True, "")
        messages = [s for s in segments if s.kind == "message"]
        # Selection queries: the generation prompt plus the newest known message(s), at least
        # SELECT_WINDOW tokens, standing in for the real tail that is not known yet.
        select_from = len(ids)
        for seg in reversed(messages):
            select_from = seg.start
            if len(ids) - select_from >= SELECT_WINDOW:
                break
        req = self.ctx.side_request(f"prefetch-{agent}-{src.request_id}", agent, prompt, self._options(src.options))
        return _Prediction(req, select_from)

    def _options(self, options: ReuseOptions) -> ReuseOptions:
        return replace(options, recompute_ratio=max(options.recompute_ratio, self.ratio))

    def run_for(self, agents: set[str]) -> None:
        """Run the queued prefetches of these agents now (their real requests are about to be admitted)."""
        for agent in [a for a in self._queue if a in agents]:
            self._run(self._queue.pop(agent))

    def drop_for(self, agents: set[str]) -> None:
        """Drop the queued prefetches of these agents (their real requests arrived first: correcting the
        real prompt inline costs less than a prediction at the prefetch ratio)."""
        for agent in [a for a in self._queue if a in agents]:
            del self._queue[agent]
            self.stats.skipped += 1

    def run_one(self, busy: set[str]) -> None:
        """Run the oldest queued prefetch; one whose agent is already busy is dropped."""
        agent, pred = self._queue.popitem(last=False)
        if agent in busy:
            self.stats.skipped += 1
            return
        self._run(pred)

    def _run(self, pred: _Prediction) -> None:
        ctx, req, t0 = self.ctx, pred.req, time.perf_counter()
        try:
            plan = self.plan(req)                           # pins the home views
            ctx.apply(req, plan)
            view = self.view_of(req, pred.select_from)
            pending = [p for p in view.pieces if p.pending and p.home is not None]
            # An own prefix that is not a home view would need a prefill first: not worth it ahead of time.
            if plan.own_prefix_end > 0 or not pending or not ctx.reserve(req, len(req.prompt_ids)):
                self.stats.skipped += 1
                return
            self.correct(view)
            self.stats.corrections += 1
            self.stats.recomputed_tokens += req.recomputed_tokens
            self.stats.by_agent[req.agent] = self.stats.by_agent.get(req.agent, 0) + 1
        except Exception:          # a prefetch is an optimisation: the real request corrects inline
            self.stats.failed += 1
        finally:
            self.release(req)                               # unpins, and drops the method's state of it
            ctx.release(req)                                # frees its blocks
            self.stats.seconds += time.perf_counter() - t0

    def clear(self) -> None:
        self._queue.clear()
