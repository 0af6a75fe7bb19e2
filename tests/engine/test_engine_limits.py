"""The engine at its limits, on the real default model: a tiny KV budget, sync timeouts, dropped engines."""
from __future__ import annotations

import time

import pytest

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, RequestTimeoutError, ReuseOptions, SamplingParams
from kvcmas_agents.errors import ConfigError, InvalidRequestError

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


def test_dropped_engines_stop_their_worker_and_free_their_model():
    """Engines dropped without close() are collected: their finalizer stops the worker thread."""
    import gc
    import threading
    import weakref

    gc.collect()
    before = threading.active_count()
    weights = []
    for _ in range(3):
        engine = Engine(EngineConfig(reuse="kvcmas", num_threads=1))
        engine.generate_sync([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=2), timeout=60)
        weights.append(weakref.ref(engine.model.w["model.embed_tokens.weight"]))
        thread = engine._thread
        del engine
        gc.collect()
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert threading.active_count() == before
    gc.collect()
    assert all(w() is None for w in weights)


@pytest.mark.parametrize("kwargs", [{"kv_budget_bytes": 10**15}, {"dtype": "float8"}, {"device": "cuda:7"}])
def test_engine_build_errors_are_config_errors(kwargs):
    if kwargs.get("device") and __import__("torch").cuda.device_count() > 7:
        pytest.skip("this host has a cuda:7")
    with pytest.raises(ConfigError):
        Engine(EngineConfig(reuse="prefix", **kwargs))


@pytest.mark.parametrize("sampling", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"max_tokens": True}, {"top_k": 2.5},
    {"stop": 7}, {"seed": "1"}, "greedy", {"temperature": "hot"},
])
def test_bad_sampling_is_an_invalid_request(engine_prefix, sampling):
    before = engine_prefix.stats()["counters"]["requests"]
    bad = SamplingParams(**sampling) if isinstance(sampling, dict) else sampling
    with pytest.raises(InvalidRequestError):
        engine_prefix.generate_sync([{"role": "user", "content": "Hi"}], sampling=bad)
    with pytest.raises(InvalidRequestError):
        engine_prefix.generate_sync([{"role": "user", "content": "Hi"}], reuse_options={"reuse": "none"})
    assert engine_prefix.stats()["counters"]["requests"] == before


def test_one_budget_bounds_blocks_and_corrections():
    """Corrections are charged to kv_budget_bytes and evicted least recently used first: at rest, KV blocks
    and corrections together stay within the budget, however many agents correct the shared history."""
    engine = Engine(EngineConfig(reuse="kvcmas", kv_budget_bytes=16 * BLOCK_BYTES,
                                 methods={"kvcmas": KVCMASConfig(prefetch="off")}))
    budget = engine.config.kv_budget_bytes
    history = [{"role": "user", "content": "We are building a small command-line todo app in Python. " * 6},
               {"role": "assistant", "content": "It needs add, list and done commands, stored in a JSON file. " * 5}]
    try:
        for i in range(4):
            messages = [{"role": "system", "content": f"You are agent {i}, role {i * 7}."}, *history]
            out = engine.generate_sync(messages, agent=f"a{i}", sampling=SamplingParams(max_tokens=2), timeout=120)
            assert out.finish_reason in ("stop", "length") and (i == 0 or out.usage.reused_tokens > 0)
            end = time.monotonic() + 10
            while engine.stats()["memory"]["total_bytes"] > budget and time.monotonic() < end:
                time.sleep(0.05)
            mem = engine.stats()["memory"]
            assert mem["total_bytes"] <= budget, (i, mem)
        st = engine.stats()
        assert st["reuse"]["kvcmas"]["corrections_evicted"] >= 1
        assert st["memory"]["total_bytes_peak"] <= budget + st["memory"]["state_over_budget_bytes"]
    finally:
        engine.close()
