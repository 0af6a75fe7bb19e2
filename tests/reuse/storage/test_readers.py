"""Readers of stored factors: several states' U joined, bases stacked, and codes kept for a decode."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.reuse.storage.codec import Format, compress
from kvcmas_agents.reuse.storage.readers import Basis, Coeffs

L, KVH, D = 3, 2, 16


def _devs(nrows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, KVH, nrows, D, generator=g, dtype=dtype),
            torch.randn(L, KVH, nrows, D, generator=g, dtype=dtype))


@pytest.mark.parametrize("kind", ["factors", "rows"])
def test_joined_reads_states_that_start_at_different_layers(kind):
    """States of a view may leave out different leading layers (uncorrected_energy): joined gives
    each layer what the states give one by one, zeros where a state stores nothing."""
    dk, dv = _devs(20)
    rows = torch.arange(20)
    knobs = {"u8": 4, "head_bits": 6} if kind == "factors" else {"key_bits": 6, "value_bits": 6}
    states = [compress(dk, dv, rows, 8, Format(torch.int8, **knobs), first_layer=f) for f in (1, 2, 1)]
    assert [s.first_layer for s in states] == [1, 2, 1]
    for side in ("key_coeffs", "value_coeffs"):
        us = [getattr(s, side)() for s in states]
        for layer in range(L):
            want = torch.cat([u.at(layer) for u in us], dim=1)
            assert torch.equal(Coeffs.joined(us, layer), want), (side, layer)
        assert not Coeffs.joined(us, 1)[:, 20:40].any()         # the second state starts at layer 2


def test_stacked_bases_equal_each_basis_read_alone():
    """Basis.stacked dequantizes and rotates several bases in one go: bitwise what each gives alone, for
    int8 bases with scales (some rotated by a pending shift, some not), bf16 ones, the identity of
    quantized rows, and bases stored differently (read one by one)."""
    from kvcmas_agents.reuse.realign import Realigner
    from kvcmas_agents.model.rope import inv_frequencies
    inv, _ = inv_frequencies(D, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    dk, dv = _devs(20)
    rows = torch.arange(20)
    int8 = [compress(dk * (i + 1), dv, rows, 8, Format(torch.int8, int8_basis=True), first_layer=f)
            for i, f in enumerate((1, 0, 1))]
    moved = [realigner.rotate_delta(int8[0], 7), int8[1], realigner.rotate_delta(int8[2], -3)]
    bf16 = [compress(dk, dv, rows, 8, Format(torch.int8)), compress(dk * 2, dv, rows, 8, Format(torch.int8))]
    keyrows = [realigner.rotate_delta(compress(dk, dv, rows, 8, Format(torch.int8, key_bits=6)), s) for s in (0, 5)]
    for states in (moved, bf16, keyrows, [moved[0], bf16[1]]):
        bases = [realigner.key_basis(s) for s in states]
        for layer in (1, L - 1):
            want = torch.stack([b.at(layer) for b in bases])
            assert torch.equal(Basis.stacked(bases, layer), want), layer
    assert any(b.cos is not None for b in (realigner.key_basis(s) for s in moved))
    # a state that does not store the layer reads zeros there, as alone
    assert not Basis.stacked([realigner.key_basis(s) for s in moved], 0)[0].any()


@pytest.mark.parametrize("bits", [4, 8])
def test_kept_codes_read_back_joined_to_the_bit_with_and_without_channel_scales(bits):
    """Quantized rows kept for a decode (``Coeffs.exact_codes``) read back exactly what ``Coeffs.joined``
    gives, each row scaled by its own state's channel scales, ones for a state without them; the table
    of scales is counted in the kept bytes."""
    dk, dv = _devs(30)
    dk[..., :2] *= 30.0
    rows = torch.arange(0, 60, 2)
    with_channels = compress(dk[:, :, :12], dv[:, :, :12], rows[:12], 4, Format(torch.int8, value_bits=bits, key_bits=bits))
    other = compress(dk[:, :, 12:] * 2, dv[:, :, 12:], rows[12:], 4, Format(torch.int8, value_bits=bits, key_bits=bits))
    no_channels = with_channels.value_coeffs()
    assert with_channels.key_coeffs().channel is not None and no_channels.channel is None
    for us in ([with_channels.key_coeffs(), other.key_coeffs()], [with_channels.key_coeffs(), no_channels],
               [no_channels, other.value_coeffs()]):
        for layer in range(L):
            kept = Coeffs.exact_codes(us, layer)
            assert torch.equal(kept.read(torch.float32), Coeffs.joined(us, layer, torch.float32))
            assert (kept.channels is None) == all(u.channel is None for u in us)
            extra = 0
            if kept.channels is not None:
                assert kept.row_state.numel() == kept.codes.shape[1] == sum(u.num_rows for u in us)
                extra = kept.channels.numel() * kept.channels.element_size() + 4 * kept.row_state.numel()
            assert kept.nbytes == kept.codes.numel() + kept.scale.numel() * kept.scale.element_size() + extra
