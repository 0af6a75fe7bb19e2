"""Correction states composed: several as one (``compose``), and a corrected view materialized from
them (``apply_to``, the tests' oracle)."""
from __future__ import annotations

import torch

from .codec import Format, compress
from .delta import DeltaSide, LowRankDelta


def compose(deltas: list[LowRankDelta], rank: int | None = None) -> LowRankDelta:
    """One state equal to applying ``deltas`` one after another.

    Exact by default: rows are the sorted union and ranks concatenate (r = sum of r_i; B in fp32). With
    ``rank``, the summed deviation is recompressed by SVD instead, which caps the rank at a loss. States
    must not owe a shift (settle them with ``Realigner.settle`` first).
    """
    if not deltas:
        raise ValueError("compose needs at least one delta")
    first = deltas[0]
    rows = torch.cat([d.rows for d in deltas]).unique(sorted=True)
    where = [torch.searchsorted(rows, d.rows) for d in deltas]
    if rank is not None:
        _, heads, _, dim = first.key_basis().b.shape
        layers = first.num_layers
        dk = first.k.u.new_zeros(layers, heads, rows.numel(), dim, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        for d, idx in zip(deltas, where):
            dk.index_add_(2, idx, d.key_coeffs().at() @ d.key_basis().at())
            dv.index_add_(2, idx, d.value_coeffs().at() @ d.value_basis().at())
        # a side's U that is not rows, and its 8-bit components when it has a 4-bit tail
        factored = first.value_coeffs() if first.k.row_scale is not None else first.key_coeffs()
        u8 = factored.rank - factored.tail if factored.tail else None
        fmt = Format(factored.u.dtype, int8_basis=first.k.basis_scale is not None or first.v.basis_scale is not None,
                     value_bits=first.value_coeffs().bits, key_bits=first.key_coeffs().bits, u8=u8,
                     head_bits=factored.head or 8)
        return compress(dk, dv, rows, rank, fmt, first_layer=min(d.first_layer for d in deltas))

    def scatter_u(us: list[torch.Tensor]) -> torch.Tensor:
        # Each delta's U gets its own rank columns; rows it does not correct stay zero.
        layers, heads = us[0].shape[:2]
        out = us[0].new_zeros(layers, heads, rows.numel(), sum(u.shape[-1] for u in us))
        col = 0
        for u, idx in zip(us, where):
            out[:, :, idx, col:col + u.shape[-1]] = u
            col += u.shape[-1]
        return out

    return LowRankDelta(rows, DeltaSide(scatter_u([d.key_coeffs().at() for d in deltas]),
                                        torch.cat([d.key_basis().at() for d in deltas], 2)),
                        DeltaSide(scatter_u([d.value_coeffs().at() for d in deltas]),
                                  torch.cat([d.value_basis().at() for d in deltas], 2)))


def apply_to(k_ref: torch.Tensor, v_ref: torch.Tensor, deltas: list[LowRankDelta],
             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize a corrected view: k_ref/v_ref [T, KVH, D] plus each delta's rows at ``layer`` (shift 0).

    Row sets may differ or overlap; overlapping corrections add. Meant as a test oracle and for small
    cases: attention over a view never needs this copy.
    """
    k, v = k_ref.clone(), v_ref.clone()
    for d in deltas:
        dk, dv = d.dense(layer)                       # [KVH, R, D]
        k.index_add_(0, d.rows, dk.transpose(0, 1).to(k.dtype))
        v.index_add_(0, d.rows, dv.transpose(0, 1).to(v.dtype))
    return k, v
