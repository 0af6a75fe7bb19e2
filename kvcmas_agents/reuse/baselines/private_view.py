"""Private copies of reused segments, the base of the baselines that materialize a per-request view.

CacheBlend and KVCOMM give a request its own KV rows for the reused spans, unlike KVCMAS: the
realigned home KV is copied into the request's blocks, adjusted there, and some rows are recomputed
in place under the request's own context. The copy lives in the request's own blocks, so the KV
store's byte figures count it; it is freed with the request. Nothing persists but what a subclass keeps.
"""
from __future__ import annotations

import torch

from ..base import ReuseRequest
from ..cross_agent import CrossAgentMethod
from ..pieces import ReusePiece
from ..recompute import LayerHook, recompute
from ..request_view import CrossAgentState, attention_pieces


class PrivateCopyMethod(CrossAgentMethod):
    """Cross-agent planning whose reused pieces are served from a copy in the request's own blocks."""

    def _classify(self, req: ReuseRequest, piece: ReusePiece, tokens: tuple[int, ...]) -> None:
        piece.pending = piece.private = True       # blended / offset copy in own blocks, every request

    def own_slots(self, req: ReuseRequest, piece: ReusePiece) -> torch.Tensor:
        return self.ctx.store.slots(req.blocks, piece.start, piece.end)

    def copy_realigned(self, req: ReuseRequest, pieces: list[ReusePiece]) -> None:
        """Write each piece's home KV, keys rotated to the piece's positions, into the request's own slots."""
        store = self.ctx.store
        for p in pieces:
            src, dst = p.home.slots, self.own_slots(req, p)
            store.k[:, dst] = self.ctx.realigner.rotate_keys(store.k[:, src], p.delta)
            store.v[:, dst] = store.v[:, src]

    def recompute_rows(self, req: ReuseRequest, st: CrossAgentState, positions: torch.Tensor,
                       hook: LayerHook | None = None) -> None:
        """Recompute the KV of prompt tokens at sorted ``positions`` (< reuse_end) under the request's
        context as it stands in its blocks, and write it there in place (``recompute.recompute``)."""
        store = self.ctx.store
        ctx_slots = torch.cat([pc.slots for pc in attention_pieces(req, st, self.ctx, st.reuse_end)])   # position order

        def write(layer, pos, k_old, v_old, k_new, v_new):
            keep = hook(layer, pos, k_old, v_old, k_new, v_new) if hook is not None else None
            store.write(layer, ctx_slots[pos], k_new, v_new)
            return keep

        with req.timings.phase("recompute"):
            recompute(self.ctx.model, torch.tensor(req.prompt_ids), positions,
                      lambda layer: (store.k[layer][ctx_slots], store.v[layer][ctx_slots]), write)


def span_positions(pieces: list[ReusePiece], device: torch.device | str = "cpu") -> torch.Tensor:
    """All positions of the pieces, concatenated (pieces are given in position order)."""
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(p.start, p.end, device=device) for p in pieces])
