"""Pack view-attention pieces into the flat descriptor the Triton kernel reads (``view_path="triton"``).

Pieces become *runs*: a reused segment with corrections is a run of its own; consecutive pieces with
the same delta and no corrections (own rows, naive reuse) share one. Each run is padded to whole key
tiles, so a tile has one query rotation and one correction chain. Correction factors of all runs are
stacked, zero-padded to one rank and dequantized/rotated to fp32, once per step; the view itself is
never materialized. Triton is imported only when a descriptor is built or used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..realign import Realigner
from ..storage.delta import DeltaSide, LowRankDelta
from .reference import OwnPiece, SegmentPiece, view_attention

if TYPE_CHECKING:
    from ...kernels.view_attention import ViewDescriptor


@dataclass
class _Run:
    slots: list[torch.Tensor]
    positions: list[torch.Tensor]
    delta: int
    deltas: list[LowRankDelta] = field(default_factory=list)


def _runs(pieces: list) -> list[_Run]:
    runs: list[_Run] = []
    for p in pieces:
        if p.slots.numel() == 0:
            continue
        seg = isinstance(p, SegmentPiece)
        delta = p.delta if seg else 0
        # A correction with no rows or rank 0 adds nothing.
        deltas = [d for d in p.deltas if d.num_rows and d.rank] if seg else []
        if runs and not deltas and not runs[-1].deltas and runs[-1].delta == delta:
            runs[-1].slots.append(p.slots)
            runs[-1].positions.append(p.positions)
        else:
            runs.append(_Run([p.slots], [p.positions], delta, deltas))
    return runs


def _pad_rank(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]]
    return F.pad(t.float(), pad)          # factors may be stored in bf16; the kernel reads fp32


def pack_view(pieces: list, realigner: Realigner, device: torch.device, block_n: int = 64) -> "ViewDescriptor":
    """Flatten ``pieces`` (OwnPiece / SegmentPiece, as for ``view_attention``) for the kernel."""
    from ...kernels.view_attention import PAD_POS, ViewDescriptor

    runs = _runs(pieces)
    if not runs:
        raise ValueError("a view needs at least one key")
    rot_of = {0: 0}
    for r in runs:
        rot_of.setdefault(r.delta, len(rot_of))
    tables = [realigner.cos_sin(-d, device, torch.float32) for d in rot_of]
    corrections = [d for r in runs for d in r.deltas]
    chain = max((len(r.deltas) for r in runs), default=0)

    slots, pos, tile_rot, tile_corr, tile_ncorr, urows = [], [], [], [], [], []
    offset, first_corr, row_base = 0, 0, 0
    for r in runs:
        s, p = torch.cat(r.slots).to(device), torch.cat(r.positions).to(device)
        n = s.numel()
        tiles = -(-n // block_n)
        pad = tiles * block_n - n
        slots += [s.to(torch.int32), torch.full((pad,), -1, dtype=torch.int32, device=device)]
        pos += [p.to(torch.int32), torch.full((pad,), PAD_POS, dtype=torch.int32, device=device)]
        tile_rot += [rot_of[r.delta]] * tiles
        tile_corr += [first_corr] * tiles
        tile_ncorr += [len(r.deltas)] * tiles
        for level, d in enumerate(r.deltas):
            rows = d.rows.to(device) + offset
            urows.append((level, rows, torch.arange(row_base, row_base + d.num_rows, device=device)))
            row_base += d.num_rows
        first_corr += len(r.deltas)
        offset += tiles * block_n

    key_urow = torch.full((max(chain, 1), offset), -1, dtype=torch.int32, device=device)
    for level, rows, index in urows:
        key_urow[level, rows] = index.to(torch.int32)

    head_dim = realigner.head_dim
    if corrections:
        rank_pad = max(16, 1 << (max(d.rank for d in corrections) - 1).bit_length())
        uk = torch.cat([_pad_rank(d.key_coeffs().at(), 3, rank_pad) for d in corrections], dim=2).to(device)
        uv = torch.cat([_pad_rank(d.value_coeffs().at(), 3, rank_pad) for d in corrections], dim=2).to(device)
        bk = torch.stack([_pad_rank(realigner.key_basis(d).at(), 2, rank_pad) for d in corrections]).to(device)
        bv = torch.stack([_pad_rank(d.value_basis().at(), 2, rank_pad) for d in corrections]).to(device)
    else:
        uk = uv = torch.zeros(1, 1, 0, 16, device=device)
        bk = bv = torch.zeros(0, 1, 1, 16, head_dim, device=device)

    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return ViewDescriptor(
        key_slots=torch.cat(slots), key_pos=torch.cat(pos), tile_rot=as_i32(tile_rot),
        tile_corr=as_i32(tile_corr), tile_ncorr=as_i32(tile_ncorr),
        cos=torch.stack([c for c, _ in tables]).contiguous(), sin=torch.stack([s for _, s in tables]).contiguous(),
        key_urow=key_urow, uk=uk.contiguous(), bk=bk.contiguous(), uv=uv.contiguous(), bv=bv.contiguous(),
        block_n=block_n)


def packed_attention(q: torch.Tensor, q_positions: torch.Tensor, desc: "ViewDescriptor", k_cache: torch.Tensor,
                     v_cache: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """The Triton kernel over a packed view: same contract as ``view_attention`` (without masses)."""
    from ...kernels.view_attention import view_attention_fwd
    return view_attention_fwd(q, q_positions, k_cache, v_cache, desc, layer, scale)


def self_check(realigner: Realigner, kv_heads: int, heads: int, head_dim: int, device: torch.device,
               dtype: torch.dtype, tol: float = 5e-2) -> str | None:
    """Run the kernel once on a small random view against the torch reference (``view_attention``).

    Returns None when they agree, else why not (an exception, or the max error). The engine runs this
    before picking the kernel by default on a GPU, and falls back to the torch path with the reason in
    its stats rather than serve from a kernel it has not seen work there.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    k, v = rand(80, kv_heads, head_dim), rand(80, kv_heads, head_dim)
    rows = torch.tensor([1, 4, 9, 20], device=device)
    delta = LowRankDelta(rows, DeltaSide(rand(1, kv_heads, 4, 2) * 0.1, rand(1, kv_heads, 2, head_dim)),
                         DeltaSide(rand(1, kv_heads, 4, 2) * 0.1, rand(1, kv_heads, 2, head_dim)))
    ar = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    pieces = [OwnPiece(ar(0, 10), ar(0, 10)), SegmentPiece(ar(40, 70), ar(10, 40), delta=-30, deltas=[delta]),
              OwnPiece(ar(10, 19), ar(40, 49))]
    q, q_pos = rand(5, heads, head_dim), ar(44, 49)
    try:
        want = view_attention(q, q_pos, pieces, k, v, 0, head_dim ** -0.5, realigner).float()
        got = packed_attention(q, q_pos, pack_view(pieces, realigner, device), k, v, 0, head_dim ** -0.5).float()
    except Exception as exc:        # e.g. no compiler for this GPU
        return f"kernel failed: {exc!r}"
    err = (got - want).abs().max().item()
    return None if err <= tol else f"kernel disagrees with the torch reference: max error {err:.3g} > {tol}"
