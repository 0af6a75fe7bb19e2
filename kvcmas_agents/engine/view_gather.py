"""Fast torch path for attention over corrected views: gather, realign and correct keys on the fly.

Paged attention in torch already gathers each layer's context into a temporary tensor before SDPA.
This path does the same for a view: home keys are rotated by their segment's delta and the low-rank
rows are added while gathering, then one SDPA call runs. Nothing outlives the layer, so there is no
per-agent copy of the view. ``view_attention`` (query-side rotation, scores-level low-rank terms) is the
same math in the form the Triton kernel fuses; tests check the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import sdpa
from .lowrank import LowRankDelta
from .realign import Realigner
from .rope import rotate
from .view_attention import SegmentPiece


@dataclass
class GatheredView:
    slots: torch.Tensor                          # [N] store slots of all keys, in position order
    rot_rows: torch.Tensor                       # [M] key rows that need realignment
    cos: torch.Tensor                            # [M, 1, D] their pure rotation
    sin: torch.Tensor
    corrections: list[tuple[torch.Tensor, LowRankDelta]]   # (key rows [R], delta) to add


def build_view(pieces: list, realigner: Realigner, device: torch.device, dtype: torch.dtype) -> GatheredView:
    """Lay out pieces that cover positions [0, N) contiguously, in order."""
    slots, rot_rows, cos, sin, corrections = [], [], [], [], []
    offset = 0
    for p in pieces:
        n = p.slots.numel()
        slots.append(p.slots)
        if isinstance(p, SegmentPiece):
            if p.delta != 0:
                c, s = realigner.cos_sin(p.delta, device, dtype)
                rot_rows.append(torch.arange(offset, offset + n, device=device))
                cos.append(c.expand(n, -1))
                sin.append(s.expand(n, -1))
            for d in p.deltas:
                if d.num_rows:
                    corrections.append((d.rows.to(device) + offset, d))
        offset += n
    d_head = realigner.head_dim
    cat = lambda xs, shape: torch.cat(xs) if xs else torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
    return GatheredView(
        slots=torch.cat(slots).to(device),
        rot_rows=torch.cat(rot_rows) if rot_rows else torch.zeros(0, dtype=torch.long, device=device),
        cos=cat(cos, (0, d_head)).unsqueeze(1), sin=cat(sin, (0, d_head)).unsqueeze(1),
        corrections=corrections)


def gathered_kv(view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's corrected keys and values [N, KVH, D] (temporary)."""
    k, v = k_cache[view.slots], v_cache[view.slots]
    if view.rot_rows.numel():
        k[view.rot_rows] = rotate(k[view.rot_rows], view.cos, view.sin)
    for rows, d in view.corrections:
        k.index_add_(0, rows, (d.uk[layer] @ d.bk[layer]).transpose(0, 1).to(k.dtype))
        v.index_add_(0, rows, (d.uv[layer] @ d.bv[layer]).transpose(0, 1).to(v.dtype))
    return k, v


def gathered_attention(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layer: int, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over the view; q [Tq, H, D] -> [Tq, H, D]."""
    k, v = gathered_kv(view, k_cache, v_cache, layer)
    return sdpa(q, k, v, scale)
