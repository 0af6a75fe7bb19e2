"""Smoke test of ``kvcmas bench``: every method runs on the tiny trace and the report holds its figures.

Asserts that it runs and reports (and what must hold whatever the machine: exact modes are exact, reuse
modes reuse, kvcmas is closer to exact than naive), never a speed.
"""
from __future__ import annotations

import json

import pytest

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.cli import main


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--preset", "tiny", "--device", "cpu", "--eval-tokens", "4", "--throughput-tokens", "4",
                 "--sweep-ratios", "1.0", "--sweep-ranks", "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "bench.json").read_text())


def test_writes_json_markdown_and_plots(report):
    out, _ = report
    for name in ("bench.json", "bench.md", "ttft_per_turn.png", "peak_memory.png", "frontier.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "bench.md").read_text()
    assert all(f"| {m.label} |" in md for m in METHODS.values())


def test_every_method_reports_ttft_memory_fidelity_and_ratios(report):
    _, result = report
    entry = result["traces"]["csv"]
    assert set(entry["methods"]) == set(METHODS)
    for name, m in entry["methods"].items():
        assert m["served"] == [METHODS[name].reuse], name          # no silent fallback to another mode
        assert m["ttft_mean"] > 0 and m["ttft_p95"] >= m["ttft_p50"] > 0
        assert m["memory"]["kv_bytes_total_peak"] > 0
        assert {"ttft_speedup_vs_prefix", "ttft_speedup_vs_none", "memory_reduction_vs_kvcomm",
                "memory_reduction_vs_prefix"} <= set(m["ratios"])
    assert entry["methods"]["prefix"]["ratios"]["ttft_speedup_vs_prefix"] == pytest.approx(1.0)


def test_headline_figures_undeclared_replays_and_where_ttft_goes(report):
    """The figures a user feels are in one run: replay time and decode rate against prefix's, and TTFT
    with the agents declared and without (no edges, no declarations); and each later turn's TTFT split
    into phases, the correction's share only where there is a correction."""
    out, result = report
    entry = result["traces"]["csv"]
    methods, plain = entry["methods"], entry["undeclared"]
    assert set(plain) == {"none", "prefix", "kvcmas", "kvcmas-copy"} and not any(m["declared"] for m in plain.values())
    assert all(m["declared"] for m in methods.values())
    assert plain["kvcmas"]["engine"]["declared"] == 0 < methods["kvcmas"]["engine"]["declared"]
    # No edges given and one round: the hand-offs are learned too late to work ahead (engine/handoffs.py).
    assert (plain["kvcmas"]["engine"]["prefetch"] or {}).get("queued", 0) == 0
    for m in list(methods.values()) + list(plain.values()):
        assert m["ratios"]["replay_time_vs_prefix"] == pytest.approx(m["wall_s"] / (plain if m in plain.values()
                                                                                    else methods)["prefix"]["wall_s"])
        phases = m["ttft_phases"]
        assert phases["forward"] > 0 and sum(phases.values()) == pytest.approx(m["ttft_mean"])
    assert methods["prefix"]["ttft_phases"]["recompute"] == 0 < plain["kvcmas"]["ttft_phases"]["recompute"]
    assert {t["method"] for t in entry["throughput"]} == {"none", "prefix", "kvcmas", "kvcmas-copy", "kvcmas-idle-copy"}
    runs = {(r["method"], r["agents"]) for r in entry["concurrent_memory"]}
    assert {("kvcmas-copy", 1), ("kvcmas", 1), ("prefix", len(entry["turns"]))} <= runs   # the tiny trace has 3 turns
    md = (out / "bench.md").read_text()
    assert "What a user feels" in md and "| kvcmas, undeclared |" in md and "Agents decoding at once" in md


def test_where_the_replay_time_goes_and_the_tokens_each_replay_computed(report):
    """The work table adds up: a replay's parts sum to its wall time, prefix prefills every token it does
    not find cached, and a reusing replay counts what its corrections recomputed at turn time and ahead."""
    from kvcmas_agents.bench.report import replay_work

    out, result = report
    entry = result["traces"]["csv"]
    for m in list(entry["methods"].values()) + list(entry["undeclared"].values()):
        w = replay_work(m)
        assert w["ttft_s"] + w["ahead_s"] + w["rest_s"] == pytest.approx(m["wall_s"])
        assert w["computed"] == w["prefilled"] + w["recomputed_at_turn"] + w["recomputed_ahead"]
    prefix, kvcmas = replay_work(entry["methods"]["prefix"]), replay_work(entry["methods"]["kvcmas"])
    turns = entry["methods"]["prefix"]["turns"]
    # every replay decodes the same exact replies, token for token
    assert prefix["decoded_tokens"] == kvcmas["decoded_tokens"] > 0
    assert prefix["decode_s"] > 0 and prefix["decode_tok_s"] > 0
    assert prefix["computed"] == sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns) > 0
    assert prefix["recomputed_at_turn"] == prefix["recomputed_ahead"] == 0
    assert kvcmas["recomputed_at_turn"] + kvcmas["recomputed_ahead"] > 0
    assert kvcmas["prefilled"] < prefix["prefilled"]
    assert "Where the replay's time goes" in (out / "bench.md").read_text()


def test_exact_modes_are_exact_and_reuse_modes_reuse(report):
    _, result = report
    methods = result["traces"]["csv"]["methods"]
    for name in ("none", "prefix"):
        assert methods[name]["fidelity"]["first_token_kl_max"] < 1e-6
    for name in ("naive", "cacheblend", "kvcomm", "kvcmas"):
        assert methods[name]["fidelity"]["reused_tokens"] + methods[name]["fidelity"]["recomputed_tokens"] > 0
    assert methods["kvcmas"]["fidelity"]["reused_tokens"] > 0
    assert methods["kvcmas"]["memory"]["correction_bytes"] > methods["kvcmas"]["memory"]["correction_basis_bytes"] > 0
    assert methods["kvcmas"]["engine"]["correction_rows_dropped"] >= 0
    assert methods["naive"]["engine"]["correction_rows_dropped"] == 0
    assert methods["kvcmas"]["engine"]["correction_layers_dropped"] >= 0 == methods["naive"]["engine"]["correction_layers_dropped"]
    assert methods["kvcmas"]["engine"]["selections_capped"] == 0      # the tiny trace's windows are short
    assert methods["kvcmas"]["fidelity"]["first_token_kl_mean"] < methods["naive"]["fidelity"]["first_token_kl_mean"]


def test_agents_are_declared_to_every_reusing_engine(report):
    """As the adapters do, every replay declares the agents' system prompts first ("none" declines)."""
    _, result = report
    methods = result["traces"]["csv"]["methods"]
    assert result["config"]["declare"] is True
    assert methods["none"]["engine"]["declared"] == 0
    assert all(m["engine"]["declared"] == 3 for name, m in methods.items() if name != "none")
    assert methods["kvcmas"]["engine"]["prefetch"]["by_agent"].get("coder", 0) >= 1


def test_sweep_and_throughput(report):
    out, result = report
    entry = result["traces"]["csv"]
    (point,) = entry["sweep"]
    assert point["knobs"]["recompute_ratio"] == 1.0
    assert point["fidelity"]["first_token_kl_max"] < 1e-4            # ratio 1.0 is exact
    kvcomm = entry["methods"]["kvcomm"]["memory"]["kv_bytes_total_peak"]
    assert point["ratios"]["memory_reduction_vs_kvcomm"] == pytest.approx(
        kvcomm / point["memory"]["kv_bytes_total_peak"])            # against the same run's baseline
    (row,) = [line for line in (out / "bench.md").read_text().splitlines() if line.startswith(f"| {point['label']} |")]
    assert f"| {point['ratios']['memory_reduction_vs_kvcomm']:.2f}x |" in row
    for t in entry["throughput"]:
        assert t["concurrent_tok_s"] > 0 and t["sequential_tok_s"] > 0 and t["max_batch_seqs"] >= 2
        assert t["sequential_decode_only_tok_s"] > 0


def test_sweep_options_replace_the_presets_axes():
    import argparse

    from kvcmas_agents.bench.cli import add_args, sweep_of

    parser = argparse.ArgumentParser()
    add_args(parser)
    labels = lambda argv: [m.label for m in sweep_of(parser.parse_args(argv))]  # noqa: E731
    assert labels(["--preset", "full"]) == ["kvcmas(r=0.3)", "kvcmas(k=24)", "kvcmas(k=32)", "kvcmas(pr=0.5)",
                                            "kvcmas(prefetch=False)"]
    assert labels(["--preset", "full", "--sweep-ratios", "--sweep-ranks", "--sweep-prefetch-ratios", "0.5",
                   "0.7"]) == ["kvcmas(pr=0.5)", "kvcmas(pr=0.7)", "kvcmas(prefetch=False)"]
    assert labels(["--preset", "full", "--sweep-prefetch-ratios", "0.5", "--no-sweep"]) == []


def test_the_long_trace_fits_the_default_models_window_with_room_for_its_replies():
    """The long preset's first prompt leaves room inside the default model's 8,192 tokens for the history
    to grow by every later turn (exact passes measured 90-111 tokens a turn: a reply of up to 96
    tokens and its frame), and is long enough that it passes 8,000 shared tokens by the last turn (the
    exact pass measures and reports that)."""
    from kvcmas_agents.bench.traces import get_traces
    from kvcmas_agents.chat.template import ChatFormatter
    from kvcmas_agents.model.loader import load_model
    from kvcmas_agents.fidelity.scenarios import MODERATOR, prompt_messages

    loaded = load_model(None, "cpu", None, None)
    window = loaded.args.max_position_embeddings
    (trace,) = get_traces("long")
    _, agents, handoff = trace.scenario.schedule()[0]
    first = ChatFormatter(loaded.tokenizer, window).render(prompt_messages(trace.scenario, agents[0],
                                                                          [(MODERATOR, handoff)])).token_ids
    later_turns = sum(len(a) for _, a, _ in trace.scenario.schedule()) - 1
    assert 8000 - later_turns * 90 <= len(first) <= window - later_turns * 120, (len(first), window)


def test_dtype_option_sets_the_engines_model_and_kv_dtype():
    """``--dtype bfloat16`` on CPU builds every method's engine in bf16 (the memory a GPU run holds)."""
    import argparse
    import asyncio

    import torch

    from kvcmas_agents.bench.cli import add_args
    from kvcmas_agents.bench.runner import BenchConfig, _Bench

    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    assert parser.parse_args([]).dtype is None
    assert parser.parse_args(["--no-declare"]).no_declare and not parser.parse_args([]).no_declare
    engine = _Bench(BenchConfig([], device="cpu", dtype="bfloat16"), print).engine(METHODS["kvcmas"])
    try:
        assert engine.model.dtype == torch.bfloat16
        assert engine.stats()["engine"]["dtype"] == "bfloat16" and engine.store.k.dtype == torch.bfloat16
    finally:
        asyncio.run(engine.aclose())
