"""The fidelity harness: metrics on known distributions, scenarios, and a tiny run on the real model."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from kvcmas_agents import KVCMASConfig, ReuseOptions, StorageSpec
from kvcmas_agents.cli import COMMANDS
from kvcmas_agents.fidelity import (
    CSV_SYSTEM, CSV_TASK, SCENARIOS, SweepGrid, kl, run_fidelity, turn_metrics, write_report,
)
from kvcmas_agents.fidelity.scenarios import CSV, MODERATOR, prompt_messages
from kvcmas_agents.fidelity.summary import check_targets, pooled


# --- metrics ------------------------------------------------------------------------------------
def test_kl_of_identical_logits_is_zero():
    logits = torch.randn(49152)
    assert kl(logits, logits) == 0.0
    assert kl(logits, logits + 3.0) < 1e-12          # a constant shift is the same distribution


def test_kl_matches_hand_computation():
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl(p.log(), q.log()) == pytest.approx(expected, rel=1e-6)
    assert kl(p.log(), q.log()) != pytest.approx(kl(q.log(), p.log()), rel=1e-3)   # not symmetric


def _onehot_logits(tokens: list[int], vocab: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5.0


def test_turn_metrics_counts_the_matching_prefix():
    exact_tokens = [2, 0, 1, 1]
    exact = _onehot_logits(exact_tokens)
    mode = _onehot_logits([2, 0, 3, 1])              # diverges at step 2, agrees again later
    m = turn_metrics(exact, list(mode), exact_tokens)
    assert (m.matched, m.length, m.agreement) == (2, 4, 0.5)
    assert m.first_token_kl == 0.0 and m.step_kl[2] > 1.0
    assert m.tf_kl_mean == pytest.approx(sum(m.step_kl) / 4)
    assert m.truncate(2).agreement == 1.0 and m.truncate(2).tf_kl_mean == 0.0
    assert m.break_gap == pytest.approx(float(exact[2].max() - exact[2].topk(2).values[1]))
    assert m.truncate(2).break_gap is None and m.truncate(3).break_gap == m.break_gap
    same = turn_metrics(exact, exact, exact_tokens)
    assert same.agreement == 1.0 and same.tf_kl_mean == 0.0 and same.break_gap is None


def test_turn_metrics_needs_logits_for_every_token():
    with pytest.raises(ValueError):
        turn_metrics(_onehot_logits([1, 2]), _onehot_logits([1]), [1, 2])


def test_targets_and_pooling():
    good = {"turns": 2, "first_token_kl_mean": 0.002, "tf_kl_mean": 0.004, "agreement_mean": 0.95,
            "not_prefilled_frac_min": 0.7}
    bad = {**good, "turns": 6, "tf_kl_mean": 0.02, "not_prefilled_frac_min": 0.5}
    assert all(check_targets(good).values())
    assert check_targets(bad) == {"first_token_kl_mean": True, "tf_kl_mean": False, "agreement_mean": True,
                                  "not_prefilled_frac_min": False}
    both = pooled([good, bad])
    assert both["turns"] == 8 and both["tf_kl_mean"] == pytest.approx((2 * 0.004 + 6 * 0.02) / 8)
    assert both["not_prefilled_frac_min"] == 0.5


# --- scenarios ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_is_consistent(name):
    s = SCENARIOS[name]
    agents = {a for g in s.groups for a in g}
    assert agents == set(s.systems)
    assert {a for e in s.edges for a in e} <= agents
    history = [(MODERATOR, "next, please")] + [(a, f"reply of {a}") for a in sorted(agents)]
    prompts = [prompt_messages(s, a, history) for a in sorted(agents)]
    # The shared part is byte-identical for every agent, so its segments can be found and reused.
    assert all(p[1:] == prompts[0][1:] for p in prompts)
    assert len({p[0]["content"] for p in prompts}) == len(agents)
    assert prompts[0][2]["content"] == "next, please" and prompts[0][-1]["content"].startswith("[")
    assert len(s.schedule()) == s.rounds * len(s.groups) and all(h for _, _, h in s.schedule())


def test_long_scenarios_have_enough_turns():
    assert SCENARIOS["pipeline"].num_turns == 12 and SCENARIOS["debate"].num_turns == 9
    assert SCENARIOS["fanout"].num_turns == 8 and len(SCENARIOS["fanout"].groups[0]) == 3


def test_cli_command_registered():
    assert "fidelity" in COMMANDS


def test_storage_options_become_the_engines_storage_spec():
    import argparse

    from kvcmas_agents.fidelity.cli import add_args, settings_of, storage_of
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert storage_of(parser.parse_args([])) == StorageSpec()
    assert storage_of(parser.parse_args(["--correction-dtype", "int8", "--u8-components", "20"])) == StorageSpec(
        dtype="int8", u8_components=20)
    assert storage_of(parser.parse_args(["--u8-components", "all"])) == StorageSpec(u8_components=None)
    assert storage_of(parser.parse_args(["--small-row-bits", "8"])) == StorageSpec(small_row_bits=8)
    assert storage_of(parser.parse_args(["--u-head-bits", "8"])) == StorageSpec(u_head_bits=8)
    assert storage_of(parser.parse_args(["--value-bits", "6", "--key-bits", "6"])) == StorageSpec(value_bits=6,
                                                                                                   key_bits=6)
    assert storage_of(parser.parse_args(["--no-small-rows"])) == StorageSpec(small_rows=False)
    assert settings_of(parser.parse_args(["--prefetch-ratio", "0.7"])) == KVCMASConfig(prefetch_ratio=0.7)
    for bad in (["--u8-components", "many"], ["--small-row-bits", "5"], ["--u-head-bits", "4"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_no_declare_option():
    import argparse

    from kvcmas_agents.fidelity.cli import add_args
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args(["--no-declare"]).no_declare and not parser.parse_args([]).no_declare
    assert parser.parse_args(["--no-edges"]).no_edges and not parser.parse_args([]).no_edges


# --- a tiny run on the real model ----------------------------------------------------------------
async def test_tiny_end_to_end_run(tmp_path):
    mini = replace(CSV, name="mini", groups=CSV.groups[:2], handoffs=CSV.handoffs[:2], edges=CSV.edges[:1])
    assert set(mini.systems) >= {"planner", "coder"} and mini.task == CSV_TASK and CSV_SYSTEM
    threads = torch.get_num_threads()
    result = await run_fidelity([mini], modes=("prefix", "naive", "kvcmas"), reply_tokens=16, eval_tokens=8,
                                knobs=ReuseOptions(recompute_ratio=0.3, rank=16),
                                sweep=SweepGrid("mini", ratios=(0.3, 1.0), ranks=(16,), eval_tokens=4),
                                device="cpu", log=lambda msg: None,
                                settings=KVCMASConfig(prefetch_ratio=0.8, storage=StorageSpec(u8_components=8,
                                                                                              small_row_bits=8)))
    # Engines got the caller's thread count, and the caller's own count is back after the run.
    assert result["config"]["torch_threads"] == threads == torch.get_num_threads()
    assert result["config"]["device_used"] == "cpu" and result["config"]["dtype"] == "float32"
    paths = write_report(result, tmp_path)
    for key in ("json", "markdown", "plot"):
        assert paths[key].exists() and paths[key].stat().st_size > 0
    data = json.loads(paths["json"].read_text())
    assert {"config", "scenarios", "overall", "sweep", "timing"} <= set(data)
    entry = data["scenarios"]["mini"]
    assert {"turns", "modes", "edges", "shared_tokens_last"} <= set(entry)
    assert len(entry["turns"]) == 2 and entry["edges"] == [["planner", "coder"]]
    for mode in ("prefix", "naive", "kvcmas"):
        m = entry["modes"][mode]
        assert {"summary", "targets", "stats", "turns"} <= set(m)
        for key in ("first_token_kl", "tf_kl_mean", "agreement", "matched", "reused_frac", "recomputed_frac"):
            assert key in m["turns"][1]
    assert entry["modes"]["kvcmas"]["stats"]["prefetch_ratio"] == 0.8
    storage = data["config"]["settings"]["storage"]
    assert storage["u8_components"] == entry["modes"]["kvcmas"]["stats"]["u8_components"] == 8
    assert entry["modes"]["kvcmas"]["stats"]["correction_dtype"] == "int8_basis"
    assert storage["small_row_bits"] == entry["modes"]["kvcmas"]["stats"]["small_row_bits"] == 8
    # Every replay's engine had the agents' system prompts declared first (as the adapters do).
    assert data["config"]["declare"] is True
    assert all(entry["modes"][m]["stats"]["declared"] == len(mini.systems) for m in ("prefix", "naive", "kvcmas"))
    prefix = entry["modes"]["prefix"]["summary"]
    assert prefix["first_token_kl_max"] < 1e-6 and prefix["tf_kl_max"] < 1e-6 and prefix["agreement_min"] == 1.0
    coder = entry["modes"]["kvcmas"]["turns"][1]
    assert coder["reused_tokens"] > 0 and 0 < coder["recomputed_tokens"] < coder["reused_tokens"]
    assert entry["modes"]["naive"]["turns"][1]["recomputed_tokens"] == 0
    rows = {r["recompute_ratio"]: r for r in data["sweep"]["rows"]}
    assert rows[0.3]["source"] == "main run"             # the default setting is not replayed twice
    assert rows[1.0]["first_token_kl_max"] < 1e-6        # recomputing everything is exact
    md = paths["markdown"].read_text()
    assert "| mini | kvcmas |" in md and "recompute_ratio" in md


async def test_exact_engine_is_closed_even_when_the_exact_pass_fails():
    """run_exact_and_close never leaves the exact engine's worker (and its OpenMP team) alive."""
    from kvcmas_agents.fidelity.conversation import run_exact_and_close

    class Failing:          # stands in for an Engine whose generate raises mid-pass
        model_name, device, closed = "m", "cpu", False
        model = type("M", (), {"dtype": torch.float32})()

        async def generate(self, *args, **kwargs):
            raise RuntimeError("engine broke")

        async def aclose(self):
            self.closed = True

    engine = Failing()
    with pytest.raises(RuntimeError, match="engine broke"):
        await run_exact_and_close(engine, CSV, reply_tokens=4, eval_tokens=2)
    assert engine.closed
