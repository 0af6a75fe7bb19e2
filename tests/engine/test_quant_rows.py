"""Deviation rows quantized per row (the storage of full-rank correction states)."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.engine.quant_rows import channel_scale, dequantize_rows, normalized, quantize_rows, row_width


@pytest.mark.parametrize("bits, top", [(4, 7), (8, 127)])
def test_round_trip_error_is_within_half_a_step_of_each_rows_scale(bits, top):
    torch.manual_seed(0)
    d = torch.randn(2, 3, 50, 64) * torch.logspace(-3, 1, 50).view(1, 1, 50, 1)   # rows of very different size
    codes, scale = quantize_rows(d, bits)
    assert scale.shape == (2, 3, 50, 1) and scale.dtype == torch.bfloat16
    assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert codes.shape[-1] == (32 if bits == 4 else 64) and row_width(codes) == 64
    back = dequantize_rows(codes, scale)
    step = scale.float()
    assert ((back - d).abs() <= step / 2 + 1e-6 * d.abs()).all()
    # Each row's largest magnitude is (nearly) a code, so the error is relative to the row, not the tensor.
    rel = (back - d).norm(dim=-1) / d.norm(dim=-1)
    assert rel.max() < (0.2 if bits == 4 else 0.01)
    assert (back.abs().amax(-1) - d.abs().amax(-1)).abs().max() <= step.max() / 2 + 1e-6


def test_four_bit_codes_pack_the_two_halves_of_a_row_into_one_byte():
    d = torch.zeros(1, 1, 1, 4)
    d[..., 0], d[..., 2] = 7.0, -7.0            # scale 1: codes 7 and -7, offset by 8 -> 15 and 1
    codes, scale = quantize_rows(d, 4)
    assert scale.item() == 1.0
    assert codes.tolist() == [[[[15 | (1 << 4), 8 | (8 << 4)]]]]
    assert dequantize_rows(codes, scale).tolist() == d.tolist()


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
