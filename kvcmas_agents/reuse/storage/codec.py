"""The codec of correction states: deviations [L, KVH, R, D] -> ``LowRankDelta`` (``compress``,
``compress_joint``).

Each side (K, V) becomes a truncated SVD (``_truncated``), stored in the deviations' dtype or as int8
U codes with their scales folded into B (``_quantized``, with 6-bit leading and 4-bit trailing codes on
request), or stays full rank as quantized rows; ``Format`` holds the switches (see ``storage.delta`` for
the stored layout).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .delta import DeltaSide, LowRankDelta
from .quant_rows import BITS, channel_scale, normalized, pack_nibbles, pack_sixes, quantize_rows


# Code bits of a factored int8 U's leading components (StorageSpec.u_head_bits): 8, or 6 packed four
# codes to three bytes.
HEAD_BITS: tuple[int, ...] = (6, 8)


@dataclass(frozen=True)
class Format:
    """The codec switches of ``compress``, all off by default (factors in the deviations' dtype, every
    side factored). ``StorageSpec.format`` sets them from the engine's storage settings.

    dtype: the factors' dtype (None: the deviations'); torch.int8 stores U as codes with per-component
        scales folded into a bf16 B (``int8_basis``: B in int8 too, one fp32 scale per component).
    value_bits / key_bits: 4, 6 or 8 keeps that side full rank as quantized rows (0: factored).
    small_rows: with int8 factors, a side whose factors would take more bytes than 8-bit rows keeps
        its rows instead, in ``small_bits``.
    u8: with int8 factors, U's components past the first ``u8`` get 4-bit codes (None: none do).
    head_bits: code bits of U's leading components, 8 or 6.
    """

    dtype: torch.dtype | None = None
    int8_basis: bool = False
    value_bits: int = 0
    key_bits: int = 0
    small_rows: bool = False
    u8: int | None = None
    small_bits: int = 8
    head_bits: int = 8


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


def _int8(x: torch.Tensor, dim: int, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x as int8 codes in [-top, top] with one symmetric scale per slice along ``dim`` (the max
    magnitude maps to ``top``)."""
    if not x.numel():
        return x.to(torch.int8), x.new_ones(*(1 if d == dim % x.dim() else n for d, n in enumerate(x.shape)))
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    return torch.round(x / scale).clamp_(-top, top).to(torch.int8), scale


def u_tail(rank: int, u8: int | None) -> int:
    """How many of ``rank`` components get 4-bit codes when ``u8`` keep 8 bits (an even count: they
    pair up in bytes, so an odd remainder leaves one more component at 8 bits)."""
    return 0 if u8 is None else max(0, rank - u8) // 2 * 2


def head_codes(rank: int, u8: int | None, head_bits: int) -> int:
    """Bits of the codes of a rank-``rank`` int8 U's leading components (those ``u_tail`` leaves at 8
    bits): ``head_bits``, except that 6-bit codes pack four to three bytes, so a count not divisible by
    four (or none) keeps 8."""
    lead = rank - u_tail(rank, u8)
    return 6 if head_bits == 6 and lead and lead % 4 == 0 else 8


def _quantized(u: torch.Tensor, b: torch.Tensor, int8_basis: bool, u8: int | None = None,
               head_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """U [..., R, r] in int8 with one scale per component, folded into B ((U_q s) B == U_q (s B)).
    B stays bf16 (no scale left), or with ``int8_basis`` is quantized too, leaving one fp32 scale
    [..., r, 1] per component. With ``u8``, components past the first ``u8`` get 4-bit codes (their
    own scales, folded alike) packed two to a byte after the 8-bit ones: the SVD orders components by
    size, so the trailing ones' coarser rounding is small against the leading ones'. With
    ``head_bits=6`` the leading components get 6-bit codes, packed four to three bytes (``head_codes``
    says whether they can). Returns (U_q, B, B's scale or None, number of 4-bit components, leading
    codes' bits)."""
    tail = u_tail(u.shape[-1], u8)
    head = u.shape[-1] - tail
    bits = head_codes(u.shape[-1], u8, head_bits)
    u_q, su = _int8(u[..., :head], dim=-2, top=2 ** (bits - 1) - 1)
    if bits == 6:
        u_q = pack_sixes(u_q).view(torch.int8)
    if tail:
        u_4, s4 = _int8(u[..., head:], dim=-2, top=7)
        u_q, su = torch.cat([u_q, pack_nibbles(u_4).view(torch.int8)], -1), torch.cat([su, s4], -1)
    b = b * su.transpose(-1, -2)
    if not int8_basis:
        return u_q, b.to(torch.bfloat16), None, tail, bits
    b_q, sb = _int8(b, dim=-1)
    return u_q, b_q, sb.float(), tail, bits


def compress(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, rank: int, fmt: Format = Format(),
             first_layer: int = 0) -> LowRankDelta:
    """Truncated SVD of deviations dk/dv [L, KVH, R, D] of segment ``rows`` [R] to rank ``rank``.

    Keeps min(rank, R, D) components, so a rank >= min(R, D) reconstructs exactly. The SVD runs in fp64;
    ``fmt`` says how the result is stored (see ``Format``): int8 U codes (``_quantized``), a side kept
    as quantized rows (each key channel divided first by its scale over the rows,
    ``quant_rows.channel_scale``; no SVD runs for such a side), small corrections as rows
    (``rows_are_smaller``). Layers before ``first_layer`` are dropped: the state corrects nothing there.
    """
    if dk.shape != dv.shape or dk.dim() != 4:
        raise ValueError(f"dk {tuple(dk.shape)} and dv {tuple(dv.shape)} must both be [L, KVH, R, D]")
    if not 0 <= first_layer < dk.shape[0]:
        raise ValueError(f"first_layer must be in [0, {dk.shape[0]}), got {first_layer}")
    if rows.shape != (dk.shape[2],):
        raise ValueError(f"rows {tuple(rows.shape)} must be [R] with R = {dk.shape[2]}")
    if rows.unique().numel() != rows.numel():
        raise ValueError("rows must be unique")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    dtype, int8_basis, value_bits, key_bits = fmt.dtype or dk.dtype, fmt.int8_basis, fmt.value_bits, fmt.key_bits
    u8, small_bits, head_bits = fmt.u8, fmt.small_bits, fmt.head_bits
    rows = rows.to(device=dk.device, dtype=torch.long)
    small = fmt.small_rows and dtype == torch.int8
    if small and small_bits not in BITS:
        raise ValueError(f"small_bits must be one of {BITS}, got {small_bits!r}")
    if head_bits not in HEAD_BITS:
        raise ValueError(f"head_bits must be one of {HEAD_BITS}, got {head_bits!r}")
    if small and not key_bits and rows_are_smaller(dk.shape[2], dk.shape[3], rank, channels=True):
        key_bits = small_bits
    if small and not value_bits and rows_are_smaller(dv.shape[2], dv.shape[3], rank, channels=False):
        value_bits = small_bits
    k = _side(dk[first_layer:], rank, dtype, int8_basis, key_bits, u8, head_bits, True)
    v = _side(dv[first_layer:], rank, dtype, int8_basis, value_bits, u8, head_bits, False)
    return LowRankDelta(rows, k, v, first_layer=first_layer)


# The yardstick of rows_are_smaller, whatever bits the rows it picks are then stored in (small_bits):
# the choice of which corrections are rows was measured for fidelity at this size.
SMALL_ROW_BITS = 8


def rows_are_smaller(rows: int, dim: int, rank: int, channels: bool) -> bool:
    """Whether ``rows`` deviation rows of width ``dim`` take fewer bytes per layer and KV head as
    8-bit rows (one bf16 scale per row, and per channel for keys) than as rank-``rank`` factors with
    an int8 U and a bf16 B. At rank 40 and head_dim 64 that is below about 190 rows: a request that
    corrects only its newest reply. The rows are then also near exact, against 1-2% of the energy
    lost by its SVD. The comparison stays with those factors when they are stored smaller (an int8 B,
    a 4-bit tail of U): moving it would trade more fidelity for fewer bytes than the 4-bit tail does
    (docs/storage.md)."""
    r = min(rank, rows, dim)
    return rows * (dim * SMALL_ROW_BITS // 8 + 2) + (2 * dim if channels else 0) < rows * r + 2 * r * dim


def _side(d: torch.Tensor, rank: int, dtype: torch.dtype, int8_basis: bool, bits: int, u8: int | None,
          head_bits: int, channels: bool) -> DeltaSide:
    """One side: quantized rows with ``bits`` (B the identity; ``channels`` divides each channel by its
    scale first), else factored."""
    if not bits:
        u, b, sb, tail, head = _factored(d, rank, dtype, int8_basis, u8, head_bits)
        return DeltaSide(u, b, basis_scale=sb, tail4=tail, head_bits=head)
    c = channel_scale(d) if channels else None
    u, r = quantize_rows(d if c is None else normalized(d, c), bits)
    return DeltaSide(u, row_scale=r, channel_scale=c, row_bits=bits)


def _factored(d: torch.Tensor, rank: int, dtype: torch.dtype, int8_basis: bool, u8: int | None,
              head_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """(U, B, B's scale or None, 4-bit components, leading codes' bits or 0) of one side, stored in ``dtype``."""
    if dtype == torch.int8:
        return _quantized(*_truncated(d, rank, torch.float32), int8_basis, u8, head_bits)
    return (*_truncated(d, rank, dtype), None, 0, 0)


def compress_joint(dks: list[torch.Tensor], dvs: list[torch.Tensor], rows: list[torch.Tensor], rank: int,
                   fmt: Format = Format(), first_layer: int = 0) -> list[LowRankDelta]:
    """Compress several segments' deviations (each [L, KVH, R_i, D]) against one shared basis.

    The segments an agent corrects in one request deviate for the same reason (its own prefix), so
    one rank-``rank`` basis B per layer and KV head serves them all: each segment keeps only its rows'
    coefficients U_i, and the r x D basis is stored once instead of once per segment (so are the
    channel scales of key rows, with ``key_bits``). ``small_rows`` decides on all the segments' rows.
    """
    if not (len(dks) == len(dvs) == len(rows)) or not dks:
        raise ValueError("compress_joint needs one dk, dv and rows per segment")
    dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)
    joint = compress(dk, dv, torch.arange(dk.shape[2], device=dk.device), rank, fmt, first_layer)   # split below
    out, offset = [], 0
    for r in rows:
        n = r.numel()
        out.append(replace(joint, rows=r.to(device=joint.rows.device, dtype=torch.long),
                           k=joint.k.take_rows(offset, offset + n), v=joint.v.take_rows(offset, offset + n)))
        offset += n
    return out
