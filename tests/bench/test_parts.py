"""kvcmas bench parts: the quick pipeline under prefix and kvcmas on the real model, parts read off the
requests' own timings and the engine's stats."""
from __future__ import annotations

import asyncio

from kvcmas_agents.bench.parts import measure


def test_each_part_of_the_replay_is_read_off_the_requests_and_the_stats():
    result = asyncio.run(measure("quick", "pipeline"))
    prefix, kvcmas = result["parts"]["prefix"][0], result["parts"]["kvcmas"][0]
    for row in (prefix, kvcmas):
        phases = row["first_token_phases"]
        assert row["tokens"]["decoded_tokens"] > 0 and row["decode_s"] > 0 and row["decode_ms_per_token"] > 0
        assert 0 < phases["forward_s"] <= row["first_tokens_s"]
        # the pipeline's turns run one after another: first tokens, decode and the gaps make the replay
        assert row["between_turns_s"] >= -0.01
        assert abs(row["first_tokens_s"] + row["decode_s"] + row["between_turns_s"] - row["replay_s"]) < 0.1
        assert abs(sum(phases.values()) - row["first_tokens_s"]) < 0.05
    assert all(prefix["first_token_phases"][f"{p}_s"] == 0 for p in ("select", "recompute", "compress", "correct"))
    assert prefix["ahead_of_time_s"] == 0 and prefix["tokens"]["recomputed_ahead"] == 0
    # kvcmas corrects ahead of time (the trace's edges are set); the stats time it
    assert kvcmas["tokens"]["recomputed_ahead"] > 0 and kvcmas["ahead_of_time_s"] > 0
    assert kvcmas["first_token_phases"]["ahead_s"] <= kvcmas["ahead_of_time_s"] + 0.01
    added = result["seconds_added_vs_prefix_median"]["kvcmas"]        # one round: its own difference
    assert abs(added["replay_s"] - (kvcmas["replay_s"] - prefix["replay_s"])) < 0.11
    assert abs(added["first_token_phases.forward_s"]
               - (kvcmas["first_token_phases"]["forward_s"] - prefix["first_token_phases"]["forward_s"])) < 0.011
    assert result["replay_vs_prefix"]["prefix"] == [1.0]
    assert result["replay_vs_prefix_median"]["kvcmas"] == result["replay_vs_prefix"]["kvcmas"][0] > 0
