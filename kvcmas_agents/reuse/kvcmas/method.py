"""KVCMAS as a reuse method: cross-agent planning, plus corrections that persist per (agent, segment,
position, context), computed inline or ahead of time along the edge order."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..base import ReuseContext, ReuseRequest
from ..cross_agent import CrossAgentMethod
from ..pieces import ReusePiece
from ..registry import register
from ..request_view import CrossAgentState, RequestView
from .config import DECODE_COPY_MIN, KVCMASConfig
from .correction import Corrector
from .prefetch import Prefetcher


@register
class KVCMAS(CrossAgentMethod):
    """Query-aware selective recompute of reused segments, stored as low-rank corrections."""

    name = "kvcmas"
    config_class = KVCMASConfig

    def __init__(self, ctx: ReuseContext, settings: KVCMASConfig | None = None):
        super().__init__(ctx, settings or KVCMASConfig())
        s = self.settings
        self.corrector = Corrector(ctx, s.storage, s.recompute_newest, s.recompute_dtype)
        self.prefetcher = (Prefetcher(ctx, self.plan, self.request_view, self.correct, self.release,
                                      s.prefetch_ratio)
                           if s.prefetch != "off" else None)
        self.decode_copies = self.decode_copy_blocks = 0

    @classmethod
    def defaults(cls, config: Any) -> tuple[float, int, str]:
        s = cls.settings_of(config)
        return s.recompute_ratio, s.rank, s.reference

    def _classify(self, req: ReuseRequest, piece: ReusePiece, tokens: tuple[int, ...]) -> None:
        """A correction this agent already holds for the segment here is reused; else one is computed."""
        corr = self.ctx.segments.correction(req.agent, tokens, piece.start, piece.context)
        if corr is not None:
            piece.chain = list(corr.chain)
            piece.correction = corr
            corr.users += 1
        else:
            piece.pending = True

    def _let_go(self, st: CrossAgentState) -> None:
        for p in st.pieces:
            if p.correction is not None:
                p.correction.users -= 1
                p.correction = None
        super()._let_go(st)

    def prepare(self, req: ReuseRequest) -> None:
        self.correct(self.request_view(req))

    def correct(self, view: RequestView) -> None:
        """Correct a request's pending pieces as its view lays them out (inline, or ahead of time)."""
        self.corrector.correct(view)

    def on_computed(self, req: ReuseRequest) -> None:
        st = self.states.get(req)
        first = not (st is not None and st.registered) and not req.in_prefill
        super().on_computed(req)
        if first and self.prefetcher is not None:
            self.prefetcher.observe(req)
        if first and self.settings.decode_copy == "auto" and not req.declare \
                and req.max_new_tokens - 1 >= DECODE_COPY_MIN:
            holes = sum(1 for b in req.blocks if b < 0)
            if self.copy_view(req):
                self.decode_copies += 1
                self.decode_copy_blocks += holes

    # --- ahead-of-time corrections ---------------------------------------------------------------
    def admitting(self, agents: set[str]) -> None:
        if self.prefetcher is None:
            return
        if self.settings.prefetch == "idle":
            self.prefetcher.drop_for(agents)
        else:                                 # an agent's own queued prefetch runs before its request
            self.prefetcher.run_for(agents)

    def idle(self, busy: set[str]) -> bool:
        if self.prefetcher is None or not self.prefetcher.has_work():
            return False
        if not (busy and self.settings.prefetch == "idle"):   # "idle": wait until no request runs
            self.prefetcher.run_one(busy)
        return True

    def drop_idle_work(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.clear()

    # --- accounting ------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        return self.ctx.segments.correction_bytes + self.kept_code_bytes()

    def shed_state(self) -> bool:
        return self.ctx.segments.evict_correction()

    def stats(self) -> dict[str, Any]:
        seg, c = self.ctx.segments.stats(), self.corrector
        return {
            "settings": asdict(self.settings),
            "corrections": seg.corrections, "correction_bytes": seg.correction_bytes,
            "corrections_evicted": self.ctx.segments.corrections_evicted,
            "correction_basis_bytes": seg.basis_bytes, "correction_bytes_by_agent": seg.by_agent,
            "recompute_products": str(c.products).removeprefix("torch."),
            "rows_dropped": c.rows_dropped, "layers_dropped": c.layers_dropped,
            "selections_capped": c.selections_capped, "selections_skipped": c.selections_skipped,
            "decode_copies": self.decode_copies, "decode_copy_blocks": self.decode_copy_blocks,
            "kept_code_bytes": self.kept_code_bytes(),
            "prefetch": asdict(self.prefetcher.stats) if self.prefetcher is not None else None,
        }
