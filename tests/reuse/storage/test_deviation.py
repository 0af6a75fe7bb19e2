"""Deviation analysis: the strongest rows within an energy share, and the faint leading layers."""
from __future__ import annotations

import torch

from kvcmas_agents.reuse.storage.deviation import faint_layers, layer_energy, strongest_rows

L, KVH, D = 3, 2, 16


def test_strongest_rows_keep_the_requested_energy_with_the_fewest_rows():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(L, KVH, 6, D, generator=g), 0.01 * torch.randn(L, KVH, 4, D, generator=g)
    a[:, :, [1, 4]] *= 10                                   # two strong rows in the first segment
    energy = 2 * torch.cat([(a ** 2).sum((0, 1, 3)), (b ** 2).sum((0, 1, 3))])
    for keep in (0.5, 0.9, 0.99, 0.9999):
        kept = torch.cat(strongest_rows([a, b], [a.clone(), b.clone()], keep))
        assert energy[kept].sum() >= keep * energy.sum()
        assert energy[kept].sum() - energy[kept].min() < keep * energy.sum()      # no row to spare
        assert energy[kept].min() >= energy[~kept].max() if (~kept).any() else True
    masks = strongest_rows([a, b], [a, b], 0.9)
    assert masks[0].tolist() == [False, True, False, False, True, False] and not masks[1].any()
    assert all(m.all() for m in strongest_rows([a, b], [a, b], 1.0))


def test_faint_layers_count_the_leading_layers_within_the_share_of_each_side():
    """The leading layers whose keys' and values' squared deviations (summed over segments) stay
    together within the share of each side's own total."""
    g = torch.Generator().manual_seed(6)
    size = torch.tensor([0.01, 0.02, 0.05, 1.0, 0.001, 1.0]).view(-1, 1, 1, 1)     # 6 layers
    dks = [size * torch.randn(6, KVH, n, D, generator=g) for n in (5, 9)]
    dvs = [d.flip(-1) for d in dks]
    energy = layer_energy(dks)
    assert energy.shape == (6,) and energy.dtype == torch.float64
    assert torch.allclose(energy, sum((d.double() ** 2).sum((1, 2, 3)) for d in dks))
    share = energy.cumsum(0) / energy.sum()
    assert share[2] < 0.01 < share[3]
    assert faint_layers(dks, dvs, 0.01) == 3
    assert faint_layers(dks, dvs, float(share[0]) / 2) == 0 == faint_layers(dks, dvs, 0.0)
    assert faint_layers(dks, dvs, float(share[4]) + 1e-6) == 5          # cumulative: the strong layer 3 too
    loud = [d.clone() for d in dvs]
    loud[0][:3] *= 100                                                   # the values' leading layers are strong
    assert faint_layers(dks, loud, 0.01) == 0
