"""Property-based: random messages, sampling settings and configs thrown at the chat layer and the engine.

Every case ends in the engine's own clear error or a valid answer, within a timeout, and the worker
stays alive: a later plain request still runs.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcmas_agents import ConfigError, Engine, EngineConfig, InvalidRequestError, ReuseOptions, SamplingParams

CASE_TIMEOUT_S = 60
OUTCOMES = {"answered": 0, "rejected": 0}
ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=8), st.lists(st.integers(0, 3), max_size=2))


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy = ANY) -> st.SearchStrategy:
    """``good`` nine times in ten, else ``bad``: most cases then reach the model, some are rejected.
    (Hypothesis favours and shrinks towards 0, so 0 picks ``good``.)"""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 9 else good)


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)
MESSAGE = mostly(st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant"]),
                                                       st.sampled_from(["tool", "bogus", "", None])),
                                        "content": mostly(TEXT)}),
                 st.one_of(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), ANY,
                                           max_size=3), ANY))
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=4))
SAMPLING = mostly(st.builds(
    SamplingParams, max_tokens=mostly(st.integers(1, 3)), temperature=mostly(st.floats(0, 2)),
    top_p=mostly(st.floats(0.05, 1)), top_k=mostly(st.integers(0, 5)), seed=mostly(st.none() | st.integers(0, 9)),
    stop=mostly(st.lists(TEXT, max_size=2))))
REUSE = mostly(st.none() | st.builds(ReuseOptions, reuse=mostly(st.sampled_from(["none", "prefix", "kvcmas",
                                                                                 "naive"])),
                                     recompute_ratio=mostly(st.none() | st.floats(0, 1))))
CONFIG = st.fixed_dictionaries({}, optional={
    "reuse": mostly(st.sampled_from(["none", "prefix", "kvcmas", "naive"])),
    "kv_budget_bytes": mostly(st.integers(1, 2**30)), "block_size": mostly(st.integers(1, 64)),
    "max_batch_tokens": mostly(st.integers(1, 4096)), "max_num_seqs": mostly(st.integers(1, 64)),
    "max_context": mostly(st.none() | st.integers(1, 8192)), "device": mostly(st.just("cpu")),
    "view_path": mostly(st.just("gather")), "num_threads": mostly(st.none() | st.integers(1, 2)),
})


@pytest.fixture(scope="module")
def engine():
    """A kvcmas engine with a small budget and small steps, where reuse, chunking and the queue all act."""
    eng = Engine(EngineConfig(reuse="kvcmas", kv_budget_bytes=64 * 2 * 30 * 16 * 3 * 64 * 4, max_batch_tokens=96,
                              max_num_seqs=4))
    yield eng
    eng.close()


@settings(max_examples=60, deadline=None)
@given(CONFIG)
def test_engine_config_is_valid_or_a_config_error(kwargs):
    try:
        cfg = EngineConfig(**kwargs)
    except ConfigError:
        return
    assert isinstance(cfg.kv_budget_bytes, int) and cfg.kv_budget_bytes > 0
    assert cfg.max_context is None or cfg.max_context > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MESSAGES)
def test_chat_layer_renders_or_raises_invalid_request(engine, messages):
    try:
        prompt = engine.formatter.render(messages)
    except InvalidRequestError:
        return
    assert prompt.token_ids and prompt.segments[-1].end == len(prompt.token_ids)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MESSAGES, SAMPLING, REUSE, st.sampled_from(["a0", "a1", "a2"]))
@example([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), None, "a0")
@example([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         SamplingParams(max_tokens=2, temperature=0.7, seed=1), ReuseOptions(reuse="kvcmas"), "a1")
@example([{"role": "user", "content": "Hi"}], SamplingParams(temperature=float("nan")), None, "a2")
def test_engine_answers_or_raises_a_clear_error(engine, messages, sampling, reuse, agent):
    if sampling is None:
        sampling = SamplingParams(max_tokens=3)                   # keep each case short
    try:
        out = engine.generate_sync(messages, agent=agent, sampling=sampling, reuse_options=reuse,
                                   timeout=CASE_TIMEOUT_S)
    except InvalidRequestError:               # ContextLengthError is one
        OUTCOMES["rejected"] += 1
    else:
        OUTCOMES["answered"] += 1
        assert out.finish_reason in ("stop", "length", "tool_calls")
        assert len(out.token_ids) <= sampling.max_tokens
        assert math.isfinite(out.ttft_s)
    assert engine._thread.is_alive()


def test_engine_still_serves_after_the_random_cases(engine):
    assert OUTCOMES["answered"] >= 2 and OUTCOMES["rejected"] >= 1, OUTCOMES     # both paths were exercised
    out = engine.generate_sync([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=2),
                               timeout=CASE_TIMEOUT_S)
    assert out.finish_reason in ("stop", "length")
    st_ = engine.stats()
    assert st_["counters"]["failed"] == 0 and st_["counters"]["num_running"] == 0
