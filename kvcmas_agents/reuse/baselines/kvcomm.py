"""KVCOMM baseline (Ye et al. 2025, "KVCOMM: Online Cross-context KV-cache Communication for Efficient
LLM-based Multi-agent Systems"), written from the paper's description on this engine's primitives.

Per request of agent X, for each span reused from another agent's home view (in position order):
  1. copy the home KV into X's own blocks, keys RoPE-realigned to X's positions (the "base" KV);
  2. look up the anchors of (X, placeholder) (anchors.py: placeholder = the segment's message
     index in X's prompt) and measure the home keys' distance to each anchor's base keys;
  3. hit (nearest anchor within KVCommConfig.threshold): add the interpolated full-size offsets of the
     anchors within the threshold, all layers, K and V, to the copy;
     miss: prefill the segment densely under X's context (its KV computed at every layer, exactly as a
     plain prefill would given the context before it), and keep (home keys, exact - base) as a new
     anchor; at most KVCommConfig.anchors anchors per placeholder, the oldest is evicted.
Misses are computed after the hits are applied, so a missed segment sees its predecessors as served.
Memory: the request's copy is its own KV (kv_bytes); anchors persist (their bytes count in the engine's
memory totals). Usage: a hit counts as reused; a miss counts as recomputed and not as reused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import ReuseContext, ReuseRequest
from ..pieces import ReusePiece
from ..registry import register
from ..request_view import CrossAgentState
from .anchors import Anchor, AnchorPool, sim_layer
from .private_view import PrivateCopyMethod, span_positions


@dataclass(frozen=True)
class KVCommConfig:
    """anchors: anchors kept per (agent, placeholder), the oldest evicted beyond it; threshold: the match
    threshold on the relative key distance (anchors.py): a segment whose nearest anchor is farther is
    prefilled densely and becomes an anchor."""

    anchors: int = 20
    threshold: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.anchors, int) or isinstance(self.anchors, bool) or self.anchors < 1:
            raise ValueError(f"kvcomm anchors must be a positive int, got {self.anchors!r}")
        if not self.threshold > 0:
            raise ValueError(f"kvcomm threshold must be > 0, got {self.threshold}")


def placeholder(req: ReuseRequest, piece: ReusePiece) -> int:
    """The slot of a reused span in the agent's prompt: its chat message index (negative ordinal when the
    segment has none, e.g. an injected tool-instruction message)."""
    for i, seg in enumerate(req.prompt.segments):
        if seg.start <= piece.start < seg.end:      # a decoded reply may start inside its message
            return seg.message_index if seg.message_index is not None else -(i + 1)
    raise ValueError(f"no prompt segment holds position {piece.start}")


@register
class KVComm(PrivateCopyMethod):
    name = "kvcomm"
    config_class = KVCommConfig
    recomputes_reused = False      # a missed segment counts as recomputed, not as reused

    def __init__(self, ctx: ReuseContext, settings: KVCommConfig | None = None):
        super().__init__(ctx, settings or KVCommConfig())
        self.pool = AnchorPool(self.settings.anchors, self.settings.threshold)

    def base_keys(self, piece: ReusePiece) -> torch.Tensor:
        """The home keys at the similarity layer, in the position-0 frame, [n, KVH, D]."""
        layer = sim_layer(self.ctx.model.args.num_layers)
        return self.ctx.realigner.rotate_keys(self.ctx.store.k[layer][piece.home.slots], -piece.home.start)

    @torch.inference_mode()
    def prepare(self, req: ReuseRequest) -> None:
        store, rot = self.ctx.store, self.ctx.realigner
        st = self.states(req)
        pending = [p for p in st.pieces if p.pending and p.home is not None]
        new = [p for p in st.pieces if p.home is None]
        self.copy_realigned(req, pending)
        misses: list[tuple[ReusePiece, int, torch.Tensor]] = []
        for p in pending:
            slot, base = placeholder(req, p), self.base_keys(p)
            match = self.pool.match(req.agent, slot, base)
            if match is None:
                misses.append((p, slot, base))
                continue
            dk, dv = self.pool.offsets(match, p.end - p.start)
            dst = self.own_slots(req, p)
            store.k[:, dst] = (store.k[:, dst].float() + rot.rotate(dk, p.start)).to(store.k.dtype)
            store.v[:, dst] = (store.v[:, dst].float() + dv).to(store.v.dtype)
        self._prefill(req, st, misses, new)
        for p in pending + new:
            p.pending = False

    def _prefill(self, req: ReuseRequest, st: CrossAgentState, misses: list[tuple[ReusePiece, int, torch.Tensor]],
                 new: list[ReusePiece]) -> None:
        """Dense prefill of missed segments and new text; each missed segment becomes an anchor."""
        dev = self.ctx.device
        missed = [p for p, _, _ in misses]
        positions = torch.cat([span_positions(missed, dev), span_positions(new, dev)]).sort().values
        if positions.numel() == 0:
            return
        rows = {id(p): torch.searchsorted(positions, torch.arange(p.start, p.end, device=dev)) for p in missed}
        dks: dict[int, list[torch.Tensor]] = {id(p): [] for p in missed}
        dvs: dict[int, list[torch.Tensor]] = {id(p): [] for p in missed}

        def capture(layer, pos, k_old, v_old, k_new, v_new):
            for p in missed:                 # exact KV minus the realigned base (the copy before overwrite)
                i = rows[id(p)]
                dks[id(p)].append(k_new[i] - k_old[i])
                dvs[id(p)].append(v_new[i] - v_old[i])
            return None

        self.recompute_rows(req, st, positions, capture)
        for p, slot, base in misses:
            dk = self.ctx.realigner.rotate(torch.stack(dks[id(p)]), -p.start)    # to the position-0 frame
            self.pool.add(Anchor(req.agent, slot, base, dk, torch.stack(dvs[id(p)])))
            n = p.end - p.start
            req.reused_tokens -= n
            req.recomputed_tokens += n

    def state_bytes(self) -> int:
        return self.pool.nbytes + self.kept_code_bytes()

    def shed_state(self) -> bool:
        return self.pool.drop_oldest()

    def stats(self) -> dict:
        a = self.pool.stats()
        return {"anchors": a.anchors, "anchor_bytes": a.anchor_bytes, "anchor_bytes_by_agent": a.by_agent,
                "hits": a.hits, "misses": a.misses, "evicted": a.evicted,
                "max_anchors": self.settings.anchors, "threshold": self.settings.threshold}
