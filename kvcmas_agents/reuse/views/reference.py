"""Attention over a corrected KV view without materializing it (the torch reference path).

A sequence's context is an ordered list of pieces. Own pieces are exact KV rows in the store. A
segment piece reuses a home view stored elsewhere: its keys in this sequence are
``R(delta) k_home + scatter(rows, U_k @ B_k)``, so its scores are ``(R(-delta) q) . k_home`` plus the
low-rank term ``(q . B_k^T) . U_k^T`` on the corrected rows, and its values add ``(P[:, rows] . U_v) . B_v``.
All pieces' scores share one softmax. The Triton kernel is checked against this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union, overload

import torch

from ..realign import Realigner
from ..storage.delta import LowRankDelta


@dataclass
class OwnPiece:
    """Exact KV rows at ``slots`` [n] of the store, rotated at their own ``positions`` [n]."""

    slots: torch.Tensor
    positions: torch.Tensor


@dataclass
class SegmentPiece:
    """A reused segment: home-view ``slots`` [n] seen at logical ``positions`` [n] of this sequence.

    ``delta`` is new position - home position. ``deltas`` is the correction chain (rows index the
    segment's tokens, key factors in this sequence's positional frame); empty means naive reuse.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    delta: int = 0
    deltas: list[LowRankDelta] = field(default_factory=list)


Piece = Union[OwnPiece, SegmentPiece]


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [T, H, D] -> [KVH, G, T, D] so each KV head meets its G query heads."""
    t, heads, dim = q.shape
    return q.reshape(t, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)


def _piece_scores(qg: torch.Tensor, q: torch.Tensor, piece: Piece, k_cache: torch.Tensor, layer: int,
                  realigner: Realigner | None) -> torch.Tensor:
    """Unscaled scores [KVH, G, Tq, n] of one piece."""
    kv_heads = k_cache.shape[1]
    k = k_cache[piece.slots].float().permute(1, 0, 2)            # [KVH, n, D]
    if isinstance(piece, OwnPiece) or piece.delta == 0:
        base_q = qg
    else:
        if realigner is None:
            raise ValueError("a segment with a non-zero delta needs a realigner")
        base_q = _grouped(realigner.rotate_queries(q, piece.delta), kv_heads)
    scores = base_q @ k.unsqueeze(1).transpose(-1, -2)
    if isinstance(piece, SegmentPiece):
        for d in piece.deltas:
            # (q . B_k^T) . U_k^T: rank-r work per query instead of one dot per corrected row.
            bk = (realigner.key_basis(d) if d.shift else d.key_basis()).at(layer)
            qb = qg @ bk.unsqueeze(1).transpose(-1, -2)                         # [KVH, G, Tq, r]
            corr = qb @ d.key_coeffs().at(layer).unsqueeze(1).transpose(-1, -2)   # [KVH, G, Tq, R]
            scores.index_add_(-1, d.rows, corr)
    return scores


def _piece_output(p: torch.Tensor, piece: Piece, v_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """P_piece [KVH, G, Tq, n] times the piece's (corrected) values -> [KVH, G, Tq, D]."""
    v = v_cache[piece.slots].float().permute(1, 0, 2).unsqueeze(1)           # [KVH, 1, n, D]
    out = p @ v
    if isinstance(piece, SegmentPiece):
        for d in piece.deltas:
            pu = p.index_select(-1, d.rows) @ d.value_coeffs().at(layer).unsqueeze(1)   # [KVH, G, Tq, r]
            out = out + pu @ d.value_basis().at(layer).unsqueeze(1)
    return out


@overload
def view_attention(q: torch.Tensor, q_positions: torch.Tensor, pieces: list[Piece], k_cache: torch.Tensor,
                   v_cache: torch.Tensor, layer: int, scale: float, realigner: Realigner | None = ...,
                   return_mass: Literal[False] = ...) -> torch.Tensor: ...


@overload
def view_attention(q: torch.Tensor, q_positions: torch.Tensor, pieces: list[Piece], k_cache: torch.Tensor,
                   v_cache: torch.Tensor, layer: int, scale: float, realigner: Realigner | None = ...,
                   *, return_mass: Literal[True]) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


def view_attention(q, q_positions, pieces, k_cache, v_cache, layer, scale, realigner=None, return_mass=False):
    """Causal attention of q [Tq, H, D] (rotated at ``q_positions`` [Tq]) over the pieces' view.

    k_cache/v_cache are one layer's store tensors [S, KVH, D]; ``layer`` indexes the pieces'
    correction states. A key is visible when its logical position <= the query's. Returns the output
    [Tq, H, D] in q's dtype; with ``return_mass=True`` also, per piece, the attention mass [n] each key
    receives, summed over heads and queries (fp32). Math runs in fp32.
    """
    if not pieces:
        raise ValueError("view_attention needs at least one piece")
    tq, heads, _ = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    qf = q.float()
    qg = _grouped(qf, kv_heads)
    scores = torch.cat([_piece_scores(qg, qf, p, k_cache, layer, realigner) for p in pieces], dim=-1)
    key_pos = torch.cat([p.positions for p in pieces]).to(q.device)
    visible = key_pos.unsqueeze(0) <= q_positions.to(q.device).unsqueeze(1)          # [Tq, N]
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    # A query that sees no key gets a zero output rather than NaN.
    top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    weights = (scores - top).exp()
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)

    out = torch.zeros_like(qg)
    masses: list[torch.Tensor] = []
    start = 0
    for piece in pieces:
        n = piece.slots.numel()
        p = probs[..., start:start + n]
        out = out + _piece_output(p, piece, v_cache, layer)
        if return_mass:
            masses.append(p.sum(dim=(0, 1, 2)))
        start += n
    out = out.permute(2, 0, 1, 3).reshape(tq, heads, -1).to(q.dtype)
    return (out, masses) if return_mass else out
