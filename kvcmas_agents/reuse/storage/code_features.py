"""Packed U codes read as linear features, so a product with U needs no unpacking.

A plain U factor's codes (``readers._plain``: leading components as 6-bit codes, four in three bytes,
or as int8; trailing ones as 4-bit codes, two to a byte) are each an affine function of their bytes
and of those bytes' high bits: a 6-bit code is ``byte - 64 * (byte >> 6) - 32``, the fourth code of a
6-bit triple ``sum_q (byte_q >> 6) * 4**q - 32``, a low nibble ``byte - 16 * (byte >> 4) - 8``, a high
one ``(byte >> 4) - 8``, an int8 code ``byte - 256 * (byte >> 7)``. So ``U == F @ M`` exactly, with
features F = [bytes, their high bits, 1] and one fixed map M per layout. A reader of few queries
folds M into its small side of the product (``(q . B^T) . M^T``) and multiplies by F: on CPU one
shift, one concatenation and one cast over the bytes instead of the dozen ops of an unpack.
"""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=32)
def code_map(width: int, tail: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a plain U ``width`` bytes wide (``tail`` 4-bit components in its last ``tail // 2`` bytes,
    the leading ones ``head``-bit codes: 6, or 8 / 0 for int8): the shift that takes each byte to its
    high bits (uint8 [width]) and the map M [2 * width + 1, rank] (fp32) with U = F @ M."""
    lead = width - tail // 2
    lead_rank = lead * 4 // 3 if head == 6 else lead
    rank, one = lead_rank + tail, 2 * width
    m = torch.zeros(2 * width + 1, rank)
    shift = torch.empty(width, dtype=torch.uint8)
    if head == 6:
        w = lead // 3
        shift[:lead] = 6
        for col in range(lead):
            q, j = divmod(col, w)
            m[col, col] = 1.0                      # quarter q's code j: the byte's low six bits ...
            m[width + col, col] = -64.0
            m[width + col, 3 * w + j] = 4.0 ** q   # ... and two bits of quarter 3's code j
        m[one, :lead_rank] = -32.0
    else:
        shift[:lead] = 7
        for col in range(lead):                    # int8: the byte, less 256 when its sign bit is set
            m[col, col] = 1.0
            m[width + col, col] = -256.0
    half = tail // 2
    shift[lead:] = 4
    for j in range(half):
        col, lo, hi = lead + j, lead_rank + j, lead_rank + half + j
        m[col, lo], m[width + col, lo] = 1.0, -16.0
        m[width + col, hi] = 1.0
    m[one, lead_rank:] = -8.0
    return shift, m


def features(codes: torch.Tensor, tail: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., width] of a plain U (any 8-bit dtype) -> (F [..., 2 * width + 1] fp32, M) with
    ``F @ M`` equal to the unpacked U."""
    shift, m = code_map(codes.shape[-1], tail, head)
    b = codes.view(torch.uint8)
    f = torch.cat([b, b >> shift.to(b.device), b.new_ones(*b.shape[:-1], 1)], dim=-1).float()
    return f, m.to(b.device)
