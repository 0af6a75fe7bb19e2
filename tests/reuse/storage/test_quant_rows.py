"""Deviation rows quantized per row (the storage of full-rank correction states)."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.reuse.storage.quant_rows import (channel_scale, code_bits, dequantize_rows, normalized, pack_sixes,
                                             quantize_rows, row_width, unpack_sixes)


@pytest.mark.parametrize("bits, top", [(4, 7), (6, 31), (8, 127)])
def test_round_trip_error_is_within_half_a_step_of_each_rows_scale(bits, top):
    torch.manual_seed(0)
    d = torch.randn(2, 3, 50, 64) * torch.logspace(-3, 1, 50).view(1, 1, 50, 1)   # rows of very different size
    codes, scale = quantize_rows(d, bits)
    assert scale.shape == (2, 3, 50, 1) and scale.dtype == torch.bfloat16
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.shape[-1] == {4: 32, 6: 48, 8: 64}[bits] and row_width(codes, bits) == 64
    back = dequantize_rows(codes, scale, bits=bits)
    step = scale.float()
    assert ((back - d).abs() <= step / 2 + 1e-6 * d.abs()).all()
    # Each row's largest magnitude is (nearly) a code, so the error is relative to the row, not the tensor.
    rel = (back - d).norm(dim=-1) / d.norm(dim=-1)
    assert rel.max() < {4: 0.2, 6: 0.05, 8: 0.01}[bits]
    assert (back.abs().amax(-1, keepdim=True) / scale.float()).round().max() == top
    assert (back.abs().amax(-1) - d.abs().amax(-1)).abs().max() <= step.max() / 2 + 1e-6


def test_four_bit_codes_pack_the_two_halves_of_a_row_into_one_byte():
    d = torch.zeros(1, 1, 1, 4)
    d[..., 0], d[..., 2] = 7.0, -7.0            # scale 1: codes 7 and -7, offset by 8 -> 15 and 1
    codes, scale = quantize_rows(d, 4)
    assert scale.item() == 1.0
    assert codes.tolist() == [[[[15 | (1 << 4), 8 | (8 << 4)]]]]
    assert dequantize_rows(codes, scale).tolist() == d.tolist()


def test_six_bit_codes_pack_four_quarters_of_a_row_into_three_bytes():
    """Codes of the first three quarters sit in the low six bits of their bytes; each code of the last
    quarter is spread two bits at a time over the top bits of the three (low bits first)."""
    q = torch.tensor([[5.0, -31.0, 0.0, 31.0]])               # one column per quarter
    packed = pack_sixes(q)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 3)
    d = 31 + 32                                              # 0b111111: top bits 11, 11, 11
    assert packed.tolist() == [[(5 + 32) | (d & 3) << 6, 1 | (d >> 2 & 3) << 6, 32 | (d >> 4) << 6]]
    assert torch.equal(unpack_sixes(packed), q)
    every = torch.arange(-31, 33).float().clamp(max=31).view(4, 16)        # every code, in each quarter
    for rows in (every, every.roll(1, 0), every.T.reshape(4, 16)):
        assert torch.equal(unpack_sixes(pack_sixes(rows)), rows)


def test_six_bit_rows_name_their_bits():
    """6- and 4-bit codes are both uint8: a reader that does not pass the bits gets the 4-bit reading,
    and bits that contradict the codes' dtype raise."""
    codes, scale = quantize_rows(torch.randn(1, 1, 3, 8), 6)
    assert code_bits(codes) == 4 and code_bits(codes, 6) == 6 and row_width(codes, 6) == 8
    with pytest.raises(ValueError, match="8-bit rows"):
        code_bits(codes, 8)
    with pytest.raises(ValueError, match="6-bit rows"):
        code_bits(codes.view(torch.int8), 6)
    with pytest.raises(ValueError, match="divisible by 4"):
        quantize_rows(torch.randn(1, 1, 2, 6), 6)


def test_zero_rows_stay_zero_and_bad_widths_or_bits_raise():
    codes, scale = quantize_rows(torch.zeros(1, 2, 3, 8), 4)
    assert torch.equal(dequantize_rows(codes, scale), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="even width"):
        quantize_rows(torch.randn(1, 1, 2, 5), 4)
    with pytest.raises(ValueError, match="bits"):
        quantize_rows(torch.randn(1, 1, 2, 4), 3)


def test_channel_scales_round_small_channels_to_their_own_size():
    """A few channels far larger than the rest (as keys have) set each row's scale; dividing by the
    channels' RMS first keeps the small channels' relative error near the 4-bit step."""
    torch.manual_seed(0)
    size = torch.ones(64)
    size[:4] = 40.0                                      # four large channels
    d = torch.randn(2, 3, 200, 64) * size
    small = slice(4, None)
    plain = dequantize_rows(*quantize_rows(d, 4))
    ch = channel_scale(d)
    assert ch.shape == (2, 3, 1, 64) and ch.dtype == torch.bfloat16
    assert torch.allclose(ch.float(), d.pow(2).mean(-2, keepdim=True).sqrt(), rtol=1e-2)
    scaled = dequantize_rows(*quantize_rows(normalized(d, ch), 4)) * ch.float()
    err = lambda x: ((x - d)[..., small].norm() / d[..., small].norm()).item()  # noqa: E731
    assert err(plain) > 0.5 and err(scaled) < 0.2, (err(plain), err(scaled))
    assert ((scaled - d).norm() / d.norm()) < ((plain - d).norm() / d.norm())


def test_a_zero_channel_stays_zero_under_channel_scales():
    d = torch.randn(1, 1, 5, 8)
    d[..., 3] = 0.0
    ch = channel_scale(d)
    assert ch[..., 3].item() == 0.0
    back = dequantize_rows(*quantize_rows(normalized(d, ch), 8)) * ch.float()
    assert torch.isfinite(back).all() and (back[..., 3] == 0).all()
