"""Deviation rows quantized per row: the storage of full-rank correction states (no SVD, no basis).

Each (layer, KV head, row) of a deviation [L, KVH, R, D] keeps one bf16 scale (its largest magnitude
maps to the top code) and D codes: int8 for 8 bits; for 6 bits, four codes in three bytes (uint8
[..., 3D/4]: dims of the first three quarters in the low six bits of one byte each, the last quarter's
code split over those bytes' top two bits); for 4 bits, two codes per byte (uint8 [..., D/2]: dims
[0, D/2) in the low nibble, [D/2, D) in the high one). Packed codes are offset to be unsigned. Both
packed widths are uint8, so readers pass ``bits`` (the states record it). Key rows are first divided
by one scale per channel (``channel_scale``), shared by all the rows.
"""
from __future__ import annotations

import torch

BITS: tuple[int, ...] = (4, 6, 8)


def _top(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"rows are quantized to one of {BITS} bits, not {bits}")
    return 2 ** (bits - 1) - 1


def quantize_rows(d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d [..., R, D] -> (codes, scale [..., R, 1] bf16); codes int8 [..., R, D] (8 bits), or uint8
    [..., R, 3D/4] (6 bits) or [..., R, D/2] (4 bits)."""
    top = _top(bits)
    x = d.float()
    scale = (x.abs().amax(-1, keepdim=True) / top).to(torch.bfloat16)
    safe = scale.float().clamp_min(torch.finfo(torch.float32).tiny)    # the stored scale is the one used
    q = torch.round(x / safe).clamp_(-top, top)
    if bits == 8:
        return q.to(torch.int8), scale
    return (pack_sixes(q) if bits == 6 else pack_nibbles(q)), scale


def code_bits(codes: torch.Tensor, bits: int | None = None) -> int:
    """Bits per code of quantized rows: ``bits`` if given, else what the dtype says (int8: 8; uint8: 4,
    the packed width that predates 6-bit codes)."""
    if bits:
        if bits not in BITS or (bits == 8) != (codes.dtype == torch.int8):
            raise ValueError(f"{bits}-bit rows cannot be {codes.dtype} codes")
        return bits
    return 8 if codes.dtype == torch.int8 else 4


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                    bits: int | None = None) -> torch.Tensor:
    """The rows back in ``dtype`` [..., R, D] from ``quantize_rows``'s codes and scale (``bits`` as
    ``code_bits`` takes it)."""
    bits = code_bits(codes, bits)
    codes = codes.to(dtype) if bits == 8 else (unpack_sixes if bits == 6 else unpack_nibbles)(codes, dtype)
    return codes.mul_(scale.to(dtype))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integer-valued codes in [-7, 7], [..., W] with W even -> uint8 [..., W/2]: column j in the low
    nibble and column W/2 + j in the high one, each offset by 8 so that it is unsigned."""
    if q.shape[-1] % 2:
        raise ValueError(f"4-bit codes need an even width, got {q.shape[-1]}")
    u = (q + 8).to(torch.uint8)
    half = q.shape[-1] // 2
    return u[..., :half] | (u[..., half:] << 4)


def unpack_nibbles(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pack_nibbles`` undone: uint8 [..., W/2] -> codes [..., W] in ``dtype``."""
    return torch.cat([codes & 15, codes >> 4], dim=-1).to(dtype).sub_(8)


def pack_sixes(q: torch.Tensor) -> torch.Tensor:
    """Integer-valued codes in [-31, 31], [..., W] with W divisible by 4 -> uint8 [..., 3W/4]: column
    j of quarter 0, 1, 2 is the low six bits of byte j, W/4 + j, W/2 + j; column j of quarter 3 goes
    two bits at a time into those three bytes' top bits (low bits first). Codes are offset by 32 so
    that they are unsigned."""
    if q.shape[-1] % 4:
        raise ValueError(f"6-bit codes need a width divisible by 4, got {q.shape[-1]}")
    u = (q + 32).to(torch.uint8)
    a, b, c, d = u.chunk(4, dim=-1)
    return torch.cat([a | (d & 3) << 6, b | (d >> 2 & 3) << 6, c | (d >> 4) << 6], dim=-1)


def unpack_sixes(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pack_sixes`` undone: uint8 [..., 3W/4] -> codes [..., W] in ``dtype``."""
    w = codes.shape[-1] // 3
    hi = codes >> 6              # whole-tensor ops, then one combine: fewer ops than unpacking per quarter
    d = hi[..., :w] | hi[..., w:2 * w] << 2 | hi[..., 2 * w:] << 4
    return torch.cat([codes & 63, d], dim=-1).to(dtype).sub_(32)


def channel_scale(d: torch.Tensor) -> torch.Tensor:
    """One bf16 scale per channel of rows d [..., R, D]: the channel's RMS over the rows, [..., 1, D].

    Key deviations carry a few channels far larger than the rest (as keys do), so one scale per row
    is set by those and rounds the others coarsely, whatever their share of the logits. Rows divided
    by their channels' scales (``normalized``) quantize each channel to its own size; the per-row
    scale then follows the row's size (docs/storage.md has the errors).
    """
    return d.float().pow(2).mean(-2, keepdim=True).sqrt().to(torch.bfloat16)


def normalized(d: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """d [..., R, D] divided by its channel scales [..., 1, D] (a zero channel stays zero)."""
    return d.float() / channel.float().clamp_min(torch.finfo(torch.float32).tiny)


def row_width(codes: torch.Tensor, bits: int | None = None) -> int:
    """Width D of the rows these codes hold (``bits`` as ``code_bits`` takes it)."""
    w = codes.shape[-1]
    return {8: w, 6: w * 4 // 3, 4: w * 2}[code_bits(codes, bits)]
