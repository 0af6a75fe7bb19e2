"""Packed U codes as features: F @ M equals the unpacked U, bit for bit, for every plain layout."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.reuse.storage.code_features import code_map, features
from kvcmas_agents.reuse.storage.codec import compress, compress_joint
from kvcmas_agents.reuse.storage.readers import Coeffs, _plain
from kvcmas_agents.reuse.storage.quant_rows import pack_nibbles, pack_sixes
from kvcmas_agents.reuse.storage.codec import Format


@pytest.mark.parametrize("lead, tail, head", [(28, 12, 6), (12, 0, 6), (8, 4, 8), (40, 8, 0), (4, 2, 8)])
def test_features_times_map_is_the_unpacked_codes(lead, tail, head):
    torch.manual_seed(0)
    top = 31 if head == 6 else 127
    codes = [torch.randint(-top, top + 1, (2, 3, 50, lead))]
    codes[0][..., 0] = -top                                 # the extremes of each field
    codes[0][..., -1] = top
    packed = [pack_sixes(codes[0]).view(torch.int8) if head == 6 else codes[0].to(torch.int8)]
    if tail:
        nibbles = torch.randint(-7, 8, (2, 3, 50, tail))
        nibbles[..., 0], nibbles[..., -1] = -7, 7
        codes.append(nibbles)
        packed.append(pack_nibbles(nibbles).view(torch.int8))
    u = torch.cat(packed, dim=-1)
    want = torch.cat(codes, dim=-1).float()
    assert torch.equal(_plain(u, tail, torch.float32, head), want)      # the layout is the reader's
    f, m = features(u, tail, head)
    assert f.shape == (*u.shape[:-1], 2 * u.shape[-1] + 1) and m.shape == (2 * u.shape[-1] + 1, lead + tail)
    assert torch.equal(f @ m, want)
    shift, again = code_map(u.shape[-1], tail, head)
    assert again is m                                       # one map per layout


def test_coeffs_features_of_joined_states():
    """Coeffs.features joins several states' codes as joined does; storages it cannot read give None."""
    torch.manual_seed(1)
    rows = [torch.arange(9), torch.arange(14)]
    dks = [torch.randn(4, 3, r.numel(), 64) * 0.1 for r in rows]
    states = compress_joint(dks, [d.flip(-1) for d in dks], rows, 16, Format(torch.int8, int8_basis=True, u8=8,
                                                                             head_bits=6), first_layer=1)
    us = [s.key_coeffs() for s in states]
    f, m = Coeffs.features(us, 2)
    assert torch.equal(f @ m, Coeffs.joined(us, 2))
    assert Coeffs.features(us, 0) is None                   # a layer the states leave out
    eight = compress(dks[0], dks[0], rows[0], 16, Format(torch.int8))            # 8-bit codes: one cast already
    rowq = compress(dks[0], dks[0], rows[0], 16, Format(torch.int8, key_bits=6, value_bits=6))
    assert Coeffs.features([eight.key_coeffs()], 1) is None
    assert Coeffs.features([rowq.key_coeffs()], 1) is None
    assert Coeffs.features([us[0], eight.key_coeffs()], 2) is None      # not stored alike
