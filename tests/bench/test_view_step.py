"""benchmarks/view_step: a quick trace's last view on the real model, each part timed."""
from __future__ import annotations

import asyncio

from benchmarks.view_step import run
from kvcmas_agents.reuse.views import gather


def test_a_later_agents_decode_view_is_captured_and_each_part_is_timed():
    result = asyncio.run(run("quick", "pipeline", reps=1, rounds=1, threads=(1,)))
    view = result["view"]
    assert view["layers"] == 30 and view["keys"] > view["corrected_rows"] > 0 and view["groups"]
    assert 0 < view["rotated_keys"] <= view["keys"] and view["position_shifts"] > 0
    loops = {"prefix_loops"} if result["cpu_loops"] == "built" else set()
    assert set(result["ms_per_step"]["1"]) == {"prefix", "kvcmas", "kvcmas_torch", "no_lowrank", "no_rotation"} | loops
    assert all(ms > 0 for ms in result["ms_per_step"]["1"].values())
    assert gather.gathered_attention.__name__ == "gathered_attention"     # the spy is gone
