"""Compact correction states: a truncated SVD of the deviation of a segment's corrected rows.

For one segment, the corrected view is ``K_ref + scatter(rows, U_k @ B_k)`` per layer and KV head
(likewise for V). Factors are stored as ``U`` [L, KVH, R, r] (singular values folded in) and ``B``
[L, KVH, r, D], so a state costs O(R * r + r * D) per head instead of O(T * D).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class LowRankDelta:
    """Deviation of ``rows`` of a segment, per layer and KV head: K rows += uk @ bk, V rows += uv @ bv.

    Key factors live in the positional frame of the view they correct (see ``Realigner.rotate_delta``).
    """

    rows: torch.Tensor   # LongTensor [R], unique indices into the segment's tokens
    uk: torch.Tensor     # [L, KVH, R, r]
    bk: torch.Tensor     # [L, KVH, r, D]
    uv: torch.Tensor     # [L, KVH, R, r]
    bv: torch.Tensor     # [L, KVH, r, D]

    def __post_init__(self) -> None:
        layers, heads, nrows, _ = self.uk.shape
        if self.rows.shape != (nrows,) or self.uv.shape[:3] != (layers, heads, nrows):
            raise ValueError(f"rows {tuple(self.rows.shape)} do not match factors {tuple(self.uk.shape)}")
        if self.bk.shape[:3] != (layers, heads, self.uk.shape[3]) or \
                self.bv.shape[:3] != (layers, heads, self.uv.shape[3]):
            raise ValueError("U and B factors disagree on rank or layout")

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "LowRankDelta":
        """A state that corrects nothing (R = 0, r = 0)."""
        u = torch.zeros(num_layers, kv_heads, 0, 0, dtype=dtype, device=device)
        b = torch.zeros(num_layers, kv_heads, 0, head_dim, dtype=dtype, device=device)
        return cls(torch.zeros(0, dtype=torch.long, device=device), u, b, u.clone(), b.clone())

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def rank(self) -> int:
        """Largest of the key and value ranks."""
        return max(self.uk.shape[-1], self.uv.shape[-1])

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the state's tensors, rows included."""
        return sum(t.numel() * t.element_size() for t in (self.rows, self.uk, self.bk, self.uv, self.bv))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rows, self.uk, self.bk, self.uv, self.bv)

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed deviations (dk, dv), each [KVH, R, D], for one layer."""
        return (self.uk[layer].to(self.bk.dtype) @ self.bk[layer],
                self.uv[layer].to(self.bv.dtype) @ self.bv[layer])

    def to(self, device: torch.device | str) -> "LowRankDelta":
        return LowRankDelta(*(t.to(device) for t in (self.rows, self.uk, self.bk, self.uv, self.bv)))


def _truncated(d: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched truncated SVD of d [..., R, D] -> (U * S [..., R, r], Vh [..., r, D]).

    Computed from the eigendecomposition of the smaller Gram matrix (d^T d or d d^T, in fp64): for the
    small matrices here that is several times faster than ``torch.linalg.svd`` and, in fp64, as accurate
    for the leading components that are kept.
    """
    rows, dim = d.shape[-2], d.shape[-1]
    r = min(rank, rows, dim)
    if r == 0:
        return d.new_zeros(*d.shape[:-1], 0, dtype=dtype), d.new_zeros(*d.shape[:-2], 0, dim, dtype=dtype)
    x = d.double()
    if rows >= dim:
        _, vecs = torch.linalg.eigh(x.transpose(-1, -2) @ x)          # ascending eigenvalues
        v = vecs[..., -r:].flip(-1)                                     # [..., D, r], leading first
        return (x @ v).to(dtype), v.transpose(-1, -2).to(dtype)
    _, vecs = torch.linalg.eigh(x @ x.transpose(-1, -2))
    u = vecs[..., -r:].flip(-1)                                         # [..., R, r]
    return u.to(dtype), (u.transpose(-1, -2) @ x).to(dtype)


def _quantized(u: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U [..., R, r] as int8 with one scale per component (column), folded into B [..., r, D] (bf16):
    (U_q * s) @ B == U_q @ (s * B), so readers only cast U_q; no separate scale tensor to carry."""
    if u.numel() == 0:
        return u.to(torch.int8), b.to(torch.bfloat16)
    scale = u.abs().amax(dim=-2, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # [..., 1, r]
    u_q = torch.round(u / scale).clamp_(-127, 127).to(torch.int8)
    return u_q, (b * scale.transpose(-1, -2)).to(torch.bfloat16)


def compress(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, rank: int,
             dtype: torch.dtype | None = None) -> LowRankDelta:
    """Truncated SVD of deviations dk/dv [L, KVH, R, D] of segment ``rows`` [R] to rank ``rank``.

    Keeps min(rank, R, D) components, so a rank >= min(R, D) reconstructs exactly. The SVD runs in fp64;
    factors are stored in ``dtype`` (default: dk's dtype). ``torch.int8`` stores U quantized per
    component and B in bf16 (see ``_quantized``).
    """
    if dk.shape != dv.shape or dk.dim() != 4:
        raise ValueError(f"dk {tuple(dk.shape)} and dv {tuple(dv.shape)} must both be [L, KVH, R, D]")
    if rows.shape != (dk.shape[2],):
        raise ValueError(f"rows {tuple(rows.shape)} must be [R] with R = {dk.shape[2]}")
    if rows.unique().numel() != rows.numel():
        raise ValueError("rows must be unique")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    dtype = dtype or dk.dtype
    if dtype == torch.int8:
        uk, bk = _quantized(*_truncated(dk, rank, torch.float32))
        uv, bv = _quantized(*_truncated(dv, rank, torch.float32))
    else:
        uk, bk = _truncated(dk, rank, dtype)
        uv, bv = _truncated(dv, rank, dtype)
    return LowRankDelta(rows.to(device=dk.device, dtype=torch.long), uk, bk, uv, bv)


def compress_joint(dks: list[torch.Tensor], dvs: list[torch.Tensor], rows: list[torch.Tensor], rank: int,
                   dtype: torch.dtype | None = None) -> list[LowRankDelta]:
    """Compress several segments' deviations (each [L, KVH, R_i, D]) against one shared basis.

    The segments an agent corrects in one request deviate for the same reason (its own prefix), so
    one rank-``rank`` basis B per layer and KV head serves them all: each segment keeps only its rows'
    coefficients U_i, and the r x D basis is stored once instead of once per segment.
    """
    if not (len(dks) == len(dvs) == len(rows)) or not dks:
        raise ValueError("compress_joint needs one dk, dv and rows per segment")
    dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)
    joint = compress(dk, dv, torch.arange(dk.shape[2], device=dk.device), rank, dtype)  # rows split below
    out, offset = [], 0
    for r in rows:
        n = r.numel()
        # Own copies of U rows (not views), so each segment's bytes are its own; B is shared.
        out.append(LowRankDelta(r.to(device=joint.uk.device, dtype=torch.long),
                                joint.uk[:, :, offset:offset + n].clone(), joint.bk,
                                joint.uv[:, :, offset:offset + n].clone(), joint.bv))
        offset += n
    return out


def unique_nbytes(deltas: Iterable[LowRankDelta], bases_only: bool = False) -> int:
    """Bytes held by these deltas, counting a tensor shared by several of them (a joint basis) once;
    ``bases_only`` counts only the B factors."""
    seen: set[int] = set()
    total = 0
    for d in deltas:
        for t in ((d.bk, d.bv) if bases_only else d.tensors()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def captured_energy(d: torch.Tensor, rank: int, reduce: bool = True) -> torch.Tensor:
    """Share of squared Frobenius norm that the top ``rank`` singular values of d [..., R, D] hold.

    ``reduce=True`` gives one fp32 scalar over all matrices (energy-weighted); otherwise one value per
    matrix. A matrix with no energy counts as fully captured.
    """
    s2 = torch.linalg.svdvals(d.float()).pow(2)
    kept, total = s2[..., :rank].sum(-1), s2.sum(-1)
    if reduce:
        kept, total = kept.sum(), total.sum()
    return torch.where(total > 0, kept / total.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(total))


def compose(deltas: list[LowRankDelta], rank: int | None = None) -> LowRankDelta:
    """One state equal to applying ``deltas`` one after another.

    Exact by default: rows are the sorted union and ranks concatenate (r = sum of r_i). With ``rank``,
    the summed deviation is recompressed by SVD instead, which caps the rank at a loss.
    """
    if not deltas:
        raise ValueError("compose needs at least one delta")
    first = deltas[0]
    rows = torch.cat([d.rows for d in deltas]).unique(sorted=True)
    where = [torch.searchsorted(rows, d.rows) for d in deltas]
    if rank is not None:
        layers, heads, _, dim = first.bk.shape
        dk = first.bk.new_zeros(layers, heads, rows.numel(), dim, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        for d, idx in zip(deltas, where):
            dk.index_add_(2, idx, (d.uk.float() @ d.bk.float()))
            dv.index_add_(2, idx, (d.uv.float() @ d.bv.float()))
        return compress(dk, dv, rows, rank, dtype=first.uk.dtype)

    def scatter_u(us: list[torch.Tensor]) -> torch.Tensor:
        # Each delta's U gets its own rank columns; rows it does not correct stay zero.
        layers, heads = us[0].shape[:2]
        out = us[0].new_zeros(layers, heads, rows.numel(), sum(u.shape[-1] for u in us))
        col = 0
        for u, idx in zip(us, where):
            out[:, :, idx, col:col + u.shape[-1]] = u
            col += u.shape[-1]
        return out

    return LowRankDelta(rows, scatter_u([d.uk for d in deltas]), torch.cat([d.bk for d in deltas], dim=2),
                        scatter_u([d.uv for d in deltas]), torch.cat([d.bv for d in deltas], dim=2))


def apply_to(k_ref: torch.Tensor, v_ref: torch.Tensor, deltas: list[LowRankDelta],
             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize a corrected view: k_ref/v_ref [T, KVH, D] plus each delta's rows at ``layer``.

    Row sets may differ or overlap; overlapping corrections add. Meant as a test oracle and for small
    cases: attention over a view never needs this copy.
    """
    k, v = k_ref.clone(), v_ref.clone()
    for d in deltas:
        dk, dv = d.dense(layer)                       # [KVH, R, D]
        k.index_add_(0, d.rows, dk.transpose(0, 1).to(k.dtype))
        v.index_add_(0, d.rows, dv.transpose(0, 1).to(v.dtype))
    return k, v
