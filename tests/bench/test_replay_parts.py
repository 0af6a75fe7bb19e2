"""benchmarks/replay_parts: the quick pipeline under prefix and kvcmas on the real model, parts timed."""
from __future__ import annotations

import asyncio

from benchmarks.replay_parts import run
from kvcmas_agents.engine import paged_attention, runner
from kvcmas_agents.reuse.kvcmas import correction


def test_each_part_of_the_replay_is_timed_and_the_timers_are_taken_off_after():
    before = (runner.ModelRunner.run, paged_attention.PagedAttention.__call__, correction.Corrector.correct)
    result = asyncio.run(run("quick", "pipeline"))
    assert (runner.ModelRunner.run, paged_attention.PagedAttention.__call__, correction.Corrector.correct) == before
    prefix, kvcmas = result["parts"]["prefix"][0], result["parts"]["kvcmas"][0]
    for row in (prefix, kvcmas):
        assert 0 < row["decode_steps"] <= row["tokens"]["decoded_tokens"]      # a step decodes one token a turn
        assert 0 < row["decode_attention_s"] < row["decode_steps_s"] < row["replay_s"]
        assert row["other_s"] >= 0
    assert prefix["corrections_at_turn_s"] == prefix["corrections_ahead_s"] == 0
    assert prefix["in_corrections"]["recompute_attention_s"] == 0
    # kvcmas corrects ahead of time (the trace's edges are set) and the timers see inside it
    assert kvcmas["tokens"]["recomputed_ahead"] > 0 and kvcmas["corrections_ahead_s"] > 0
    assert kvcmas["ahead_of_time_s"] >= kvcmas["corrections_ahead_s"]
    assert kvcmas["in_corrections"]["recompute_attention_s"] > 0 and kvcmas["in_corrections"]["compress_s"] > 0
    added = result["seconds_added_vs_prefix_median"]["kvcmas"]        # one round: its own difference
    assert abs(added["replay_s"] - (kvcmas["replay_s"] - prefix["replay_s"])) < 0.11
    assert result["replay_vs_prefix"]["prefix"] == [1.0]
    assert result["replay_vs_prefix_median"]["kvcmas"] == result["replay_vs_prefix"]["kvcmas"][0] > 0
