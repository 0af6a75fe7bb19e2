"""kvcmas bench tool-loop: one round on the real model."""
from __future__ import annotations

import asyncio

from kvcmas_agents.bench.tool_loop import measure


def test_continuing_turns_are_measured_on_the_same_prompts_in_both_modes():
    result = asyncio.run(measure(1, 8, 1))
    prefix, kvcmas = result["modes"]["prefix"], result["modes"]["kvcmas"]
    assert len(prefix) == len(kvcmas) == 2
    # the reply is teacher-forced to prefix's, so every turn's prompt is the same tokens
    assert [r["prompt_tokens"] for r in prefix] == [r["prompt_tokens"] for r in kvcmas]
    # prefix finds its whole first turn cached; kvcmas reuses the first turn's corrections, recomputing nothing
    assert prefix[1]["cached_tokens"] >= prefix[0]["prompt_tokens"] and prefix[1]["reused_tokens"] == 0
    assert kvcmas[1]["reused_tokens"] > 1400 and kvcmas[1]["recomputed_tokens"] == 0
    assert 0 < kvcmas[1]["computed_tokens"] < 100
    assert prefix[1]["first_token_kl"] == 0 and kvcmas[1]["first_token_kl"] < 0.01
    assert all(r["ttft_ms"] > 0 for r in prefix + kvcmas)
