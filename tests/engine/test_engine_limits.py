"""The engine at its limits, on the real default model: a tiny KV budget, sync timeouts, dropped engines."""
from __future__ import annotations

import time

import pytest

from kvcmas_agents import Engine, EngineConfig, RequestTimeoutError, ReuseOptions, SamplingParams
from kvcmas_agents.errors import InvalidRequestError

BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4       # SmolLM2-135M, fp32, 16-token blocks
HISTORY = [{"role": "user", "content": " ".join(f"word{i}" for i in range(108))}]     # ~330 tokens


def wait_idle(engine: Engine, timeout: float = 30.0) -> dict:
    """The engine's stats once no request runs or waits."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = engine.stats()
        if st["counters"]["num_running"] == 0 and st["counters"]["num_waiting"] == 0:
            return st
        time.sleep(0.05)
    raise AssertionError("engine did not go idle")


@pytest.mark.parametrize("reuse", ["kvcmas", "prefix"])
def test_reused_history_filling_a_tiny_budget_still_runs(reuse):
    """The lead's home view of the history fills 23 blocks; a0's plan pins it, so a0 could never be
    admitted with it. It must run (exactly prefilled) instead of waiting forever with the worker spinning."""
    engine = Engine(EngineConfig(reuse=reuse, kv_budget_bytes=23 * BLOCK_BYTES))
    try:
        sampling = SamplingParams(max_tokens=4)
        engine.generate_sync([{"role": "system", "content": "You are the lead."}] + HISTORY, agent="lead",
                             sampling=sampling, timeout=60)
        a0 = [{"role": "system", "content": "You are agent zero, a helper."}] + HISTORY
        out = engine.generate_sync(a0, agent="a0", sampling=sampling, timeout=60)
        exact = engine.generate_sync(a0, agent="solo", sampling=sampling, timeout=60,
                                     reuse_options=ReuseOptions(reuse="none"))
        assert out.finish_reason == "length" and out.token_ids == exact.token_ids
        if reuse == "kvcmas":
            assert engine.stats()["counters"]["budget_fallbacks"] >= 1 and out.reuse == "none"
    finally:
        engine.close()


def test_generate_sync_timeout_aborts_the_request(engine_prefix):
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        engine_prefix.generate_sync([{"role": "user", "content": "Count to a thousand."}], agent="t",
                                    sampling=long, timeout=0.5)
    assert time.monotonic() - t0 < 5
    st = wait_idle(engine_prefix)
    assert st["counters"]["aborted"] >= 1 and st["memory"]["blocks_in_use"] == 0
    out = engine_prefix.generate_sync([{"role": "user", "content": "Hi"}], agent="t",
                                      sampling=SamplingParams(max_tokens=2), timeout=60)
    assert out.finish_reason == "length"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "5", True])
def test_generate_sync_rejects_bad_timeouts(engine_prefix, timeout):
    with pytest.raises(InvalidRequestError, match="timeout"):
        engine_prefix.generate_sync([{"role": "user", "content": "Hi"}], timeout=timeout)
