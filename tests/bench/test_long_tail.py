"""benchmarks/long_tail: one small run on the real model."""
from __future__ import annotations

import asyncio

from benchmarks.long_tail import run
from kvcmas_agents.reuse.kvcmas.select import SELECT_MAX


def test_a_long_tail_is_reported_for_every_mode_with_kvcmas_selection_cut():
    # A low ratio over enough shared rows that the cut pass spares more rows than it has queries.
    result = asyncio.run(run(shared_tokens=700, tail_tokens=SELECT_MAX + 200, recompute_ratio=0.1))
    modes = result["modes"]
    assert list(modes) == ["none", "prefix", "kvcmas"]
    none, ours = modes["none"], modes["kvcmas"]
    assert none["vs_none"] == 1.0 and none["first_token_kl"] == 0.0 and none["reused_tokens"] == 0
    assert ours["prompt_tokens"] == none["prompt_tokens"] > SELECT_MAX + 200
    assert ours["reused_tokens"] > 600 and 0 < ours["recomputed_tokens"] <= ours["reused_tokens"]
    assert ours["selections_capped"] == 1 and ours["selections_skipped"] == 0
    assert modes["prefix"]["selections_capped"] == 0
    assert all(m["ttft_s"] > 0 for m in modes.values()) and ours["first_token_kl"] < 0.05
