"""kvcmas bench turn-time: one round on the real model, nothing declared."""
from __future__ import annotations

import asyncio

from kvcmas_agents.bench.team_history import LATER
from kvcmas_agents.bench.turn_time import measure
from kvcmas_agents import KVCMASConfig
from kvcmas_agents.reuse.kvcmas.select import NEWEST_SPAN


def test_later_agents_are_reported_with_their_phases_and_fidelity():
    settings = KVCMASConfig()
    result = asyncio.run(measure(1, {"prefix": ("prefix", KVCMASConfig()), "kvcmas": ("kvcmas", settings)}))
    prefix, ours = result["modes"]["prefix"], result["modes"]["kvcmas"]
    assert result["history_tokens"] > 1400 and prefix["speedup_vs_prefix"] == 1.0
    for agent in LATER:
        p, k = prefix["agents"][agent], ours["agents"][agent]
        assert p["reused_tokens"] == 0 and p["first_token_kl"] == 0.0 and p["phases"]["forward"] > 0
        assert k["prompt_tokens"] == p["prompt_tokens"] and k["reused_tokens"] == result["history_tokens"]
        # the ratio's share, plus the newest message's rows near the tail: not a whole prefill
        assert 0 < k["recomputed_tokens"] <= settings.recompute_ratio * k["reused_tokens"] + NEWEST_SPAN
        assert k["phases"]["select"] > 0 and k["phases"]["recompute"] > 0 and k["phases"]["compress"] > 0
        assert k["first_token_kl"] < 0.01 and k["same_top1"]
    assert ours["speedup_vs_prefix"] == prefix["ttft_mean_s"] / ours["ttft_mean_s"]


def test_bf16_adds_a_variant_in_bf16_products_beside_each_ratio():
    import argparse

    from kvcmas_agents.bench.turn_time import add_args, variants_of
    parser = argparse.ArgumentParser()
    add_args(parser)
    variants = variants_of(parser.parse_args(["--ratio", "0.3", "--bf16"]))
    assert list(variants) == ["prefix", "kvcmas@0.3", "kvcmas@0.3-bf16"]
    mode, cfg = variants["kvcmas@0.3-bf16"]
    assert mode == "kvcmas" and cfg.recompute_dtype == "bfloat16" and cfg.recompute_ratio == 0.3
    assert variants["kvcmas@0.3"][1].recompute_dtype == "model"
