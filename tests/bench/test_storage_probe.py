"""The storage probe: its energy measures on synthetic deviations, and one tiny run on the real model."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.storage_probe import (allocation, analyse, captured_energy, layer_shares, main, projection_loss,
                                     rows_loss, svd_basis)


@pytest.mark.parametrize("rank", [0, 1, 4, 8])
def test_captured_energy_is_the_kept_singular_values_share(rank):
    d = torch.randn(3, 2, 24, 16, generator=torch.Generator().manual_seed(rank))
    s2 = torch.linalg.svdvals(d).pow(2)
    torch.testing.assert_close(captured_energy(d, rank, reduce=False), s2[..., :rank].sum(-1) / s2.sum(-1))
    overall = captured_energy(d, rank)
    assert overall.dim() == 0
    torch.testing.assert_close(overall, s2[..., :rank].sum() / s2.sum())
    assert captured_energy(d, 16).item() == pytest.approx(1.0, abs=1e-6)


def test_captured_energy_of_a_low_rank_or_empty_input():
    g = torch.Generator().manual_seed(3)
    true = torch.randn(3, 2, 30, 4, generator=g) @ torch.randn(3, 2, 4, 16, generator=g)
    assert captured_energy(true, 4).item() == pytest.approx(1.0, abs=1e-6)
    assert captured_energy(true, 2).item() < 0.999
    assert torch.equal(captured_energy(torch.zeros(3, 2, 0, 16), 4), torch.tensor(1.0))


def test_rows_lose_more_with_fewer_bits_and_channel_scales_help_keys():
    torch.manual_seed(0)
    d = torch.randn(2, 3, 40, 64)
    d[..., :3] *= 30.0                             # a few large channels, as keys have
    lost = {b: rows_loss(d, b, channels=True) for b in (8, 6, 4)}
    assert 0 < lost[8] < lost[6] < lost[4] < 0.05, lost
    assert rows_loss(d, 4, channels=False) > lost[4]


def test_projection_on_its_own_full_basis_loses_nothing_and_on_an_unrelated_one_most():
    torch.manual_seed(1)
    d = torch.randn(3, 20, 16)
    assert projection_loss(d, svd_basis(d, 16)) < 1e-12
    assert 0 < projection_loss(d, svd_basis(d, 4)) < projection_loss(d, svd_basis(torch.randn(3, 20, 16), 4))


def test_allocation_by_energy_spends_components_where_the_energy_is():
    """Rank 2 in each of two matrices is 4 components and loses 1 + 0.09 of energy; by energy, the
    strong matrix's three components alone lose less (0.5)."""
    strong, faint = torch.tensor([10.0, 5.0, 1.0]), torch.tensor([0.5, 0.4, 0.3])
    assert allocation([torch.stack([strong, faint])], rank=2) == (4, 3)
    assert allocation([torch.stack([strong, strong])], rank=2) == (4, 4)     # nothing to move


def test_analyse_splits_small_from_factored_deviations():
    torch.manual_seed(2)
    big = {"agent": "a", "request": "1", "rows": 300, "dk": torch.randn(3, 2, 300, 64), "dv": torch.randn(3, 2, 300,
                                                                                                          64)}
    small = {"agent": "a", "request": "2", "rows": 50, "dk": torch.randn(3, 2, 50, 64), "dv": torch.randn(3, 2, 50, 64)}
    out = analyse([big, small], rank=40, first=1)
    assert (out["small_requests"], out["small_rows"], out["factored_requests"]) == (1, 50, 1)
    lost = out["small_lost"]
    assert lost["rows8"]["dk"] < lost["rows6"]["dk"] < lost["rows4"]["dk"] < lost["svd40"]["dk"]
    assert out["small_lost"]["agent_basis_requests"] == 1
    assert lost["agent_basis"]["dv"] > lost["svd40"]["dv"]       # unrelated noise: another basis fits worse
    assert out["allocation_dk"]["uniform"] == 2 * 2 * 40
    assert out["layers"]["first_layers"] == {1: 2}                   # faint=0: every request from layer 1
    assert abs(sum(out["layers"]["dk"]) - 1) < 1e-9


def test_layer_shares_places_the_first_stored_layer_past_the_faint_ones():
    torch.manual_seed(3)
    size = torch.tensor([0.0, 0.01, 0.01, 1.0, 1.0]).view(-1, 1, 1, 1)
    calls = [{"dk": size * torch.randn(5, 2, 30, 8), "dv": size * torch.randn(5, 2, 30, 8)} for _ in range(3)]
    out = layer_shares(calls, 0.01)
    assert out["dk"][0] == 0 and max(out["dk"][1:3]) < 0.001 < min(out["dk"][3:])
    assert out["first_layers"] == {3: 3}
    assert layer_shares(calls, 0.0)["first_layers"] == {1: 3}


def test_tiny_run_reports_held_states_and_losses(tmp_path):
    assert main(["--preset", "tiny", "--trace", "csv", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "storage_probe.json").read_text())
    assert result["small_row_bits"] == 6 and result["correction_mib"] > 0
    held = result["held"]["all"]
    assert held["segments"] > 0 and held["rows"] > 0
    assert abs(held["mib"] - (result["correction_mib"] - result["basis_mib"])) < 0.01
    assert result["deviations"]["small_rows"] > 0
    md = (tmp_path / "storage_probe.md").read_text()
    assert "| rows6 |" in md and "First stored layer per request at uncorrected_energy=0.01" in md
    assert result["u_head_bits"] == 6 and sum(result["deviations"]["layers"]["first_layers"].values()) > 0
