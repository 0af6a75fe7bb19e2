"""benchmarks/aot_cost: a quick trace under prefix and three kvcmas settings on the real model."""
from __future__ import annotations

import asyncio

from benchmarks.aot_cost import run


def test_each_setting_reports_its_replay_and_what_it_computed_ahead_or_at_turn_time():
    rows = asyncio.run(run("quick", "pipeline"))["settings"]
    assert set(rows) == {"prefix", "kvcmas", "kvcmas(prefetch=False)", "kvcmas(r=0.9,prefetch=False)"}
    assert rows["prefix"]["replay_vs_prefix"] == 1.0 and rows["prefix"]["recomputed_ahead"] == 0
    assert rows["kvcmas"]["recomputed_ahead"] > 0 and rows["kvcmas"]["ahead_s"] > 0
    off, more = rows["kvcmas(prefetch=False)"], rows["kvcmas(r=0.9,prefetch=False)"]
    assert off["recomputed_ahead"] == more["recomputed_ahead"] == 0
    assert more["recomputed_at_turn"] > off["recomputed_at_turn"] > 0        # the higher ratio recomputes more
    assert all(r["first_token_kl"] is not None and r["agreement"] is not None and r["peak_mib"] > 0
               for r in rows.values())
