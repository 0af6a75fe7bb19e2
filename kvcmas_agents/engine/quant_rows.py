"""Deviation rows quantized per row: the storage of full-rank correction states (no SVD, no basis).

Each (layer, KV head, row) of a deviation [L, KVH, R, D] keeps one bf16 scale (its largest magnitude
maps to the top code) and D codes: int8 for 8 bits, or two 4-bit codes per byte for 4 bits (dims
[0, D/2) in the low nibble, [D/2, D) in the high one, each offset by 8 so that it is unsigned).
Key rows are first divided by one scale per channel (``channel_scale``), shared by all the rows.
"""
from __future__ import annotations

import torch

BITS: tuple[int, ...] = (4, 8)


def _top(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"rows are quantized to one of {BITS} bits, not {bits}")
    return 2 ** (bits - 1) - 1


def quantize_rows(d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d [..., R, D] -> (codes, scale [..., R, 1] bf16); codes int8 [..., R, D] or uint8 [..., R, D/2]."""
    top = _top(bits)
    x = d.float()
    scale = (x.abs().amax(-1, keepdim=True) / top).to(torch.bfloat16)
    safe = scale.float().clamp_min(torch.finfo(torch.float32).tiny)    # the stored scale is the one used
    q = torch.round(x / safe).clamp_(-top, top)
    if bits == 8:
        return q.to(torch.int8), scale
    return pack_nibbles(q), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows back in ``dtype`` [..., R, D] from ``quantize_rows``'s codes and scale."""
    codes = unpack_nibbles(codes, dtype) if codes.dtype == torch.uint8 else codes.to(dtype)
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


def channel_scale(d: torch.Tensor) -> torch.Tensor:
    """One bf16 scale per channel of rows d [..., R, D]: the channel's RMS over the rows, [..., 1, D].

    Key deviations carry a few channels far larger than the rest (as keys do), so one scale per row
    is set by those and rounds the others coarsely, whatever their share of the logits. Rows divided
    by their channels' scales (``normalized``) quantize each channel to its own size; the per-row
    scale then follows the row's size (README, "Correction storage", has the measured errors).
    """
    return d.float().pow(2).mean(-2, keepdim=True).sqrt().to(torch.bfloat16)


def normalized(d: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """d [..., R, D] divided by its channel scales [..., 1, D] (a zero channel stays zero)."""
    return d.float() / channel.float().clamp_min(torch.finfo(torch.float32).tiny)


def row_width(codes: torch.Tensor) -> int:
    """Width D of the rows these codes hold."""
    return codes.shape[-1] * (2 if codes.dtype == torch.uint8 else 1)
