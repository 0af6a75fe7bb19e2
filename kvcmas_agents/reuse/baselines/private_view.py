"""Private copies of reused segments, shared by the baselines that materialize a per-request view.

CacheBlend and KVCOMM give a request its own KV rows for the reused spans, unlike KVCMAS: the
realigned home KV is copied into the request's blocks, adjusted there, and some rows are recomputed
in place under the request's own context. The copy lives in the request's own blocks, so the KV
store's byte figures (kv_bytes, kv_bytes_peak) count it; it is freed with the request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .attention import rows_attention
from .request import Request, ReusePiece

if TYPE_CHECKING:
    from .correction import Corrector

# hook(layer, positions [T], k_old, v_old, k_new, v_new) -> indices into positions to keep computing, or
# None to keep all. k_old/v_old are the rows' KV in the store before this layer's new KV overwrites them.
LayerHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     "torch.Tensor | None"]


def own_slots(corr: "Corrector", req: Request, piece: ReusePiece) -> torch.Tensor:
    return corr.store.slots(req.blocks, piece.start, piece.end)


def copy_realigned(corr: "Corrector", req: Request, pieces: list[ReusePiece]) -> None:
    """Write each piece's home KV, keys rotated to the piece's positions, into the request's own slots."""
    store = corr.store
    for p in pieces:
        src, dst = p.home.slots, own_slots(corr, req, p)
        store.k[:, dst] = corr.realigner.rotate_keys(store.k[:, src], p.delta)
        store.v[:, dst] = store.v[:, src]


def context_slots(corr: "Corrector", req: Request) -> torch.Tensor:
    """Store slots of the request's context [0, reuse_end), in position order (own, private or exact)."""
    return torch.cat([pc.slots for pc in corr.pieces_for(req, req.reuse_end)])


@torch.inference_mode()
def recompute_rows(corr: "Corrector", req: Request, positions: torch.Tensor, hook: LayerHook | None = None) -> None:
    """Layer by layer, recompute the KV of prompt tokens at sorted ``positions`` (< reuse_end) under the
    request's context as it stands in the store, and write it in place.

    At each layer the rows' new KV is written before attention, so they see each other's new KV and every
    other position's stored KV (causal). A hook may narrow the rows for the following layers; rows it drops
    keep the KV written so far and their stored KV from the deeper layers.
    """
    m, store, dev = corr.model, corr.store, corr.model.device
    ctx = context_slots(corr, req)
    pos = positions.to(dev)
    if pos.numel() == 0:
        return
    h = m.embed(torch.tensor(req.prompt_ids, device=dev)[pos])
    for layer in range(m.args.num_layers):
        q, k, v = m.qkv(layer, h, pos)
        slots = ctx[pos]
        keep = hook(layer, pos, store.k[layer][slots], store.v[layer][slots], k, v) if hook else None
        store.write(layer, slots, k, v)
        if keep is not None:
            q, h, pos = q[keep], h[keep], pos[keep]
            if pos.numel() == 0:
                return
        attn = rows_attention(q, store.k[layer][ctx], store.v[layer][ctx], pos, m.scale)
        h = m.finish_layer(layer, h, attn)


def span_positions(pieces: list[ReusePiece], device: torch.device | str = "cpu") -> torch.Tensor:
    """All positions of the pieces, concatenated (pieces are given in position order)."""
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(p.start, p.end, device=device) for p in pieces])
