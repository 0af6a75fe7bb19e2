"""EngineConfig and SamplingParams reject bad values with the engine's own errors, before any work."""
from __future__ import annotations

import math

import pytest

from kvcmas_agents import ConfigError, EngineConfig, InvalidRequestError, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("max_context", 0), ("max_context", -5), ("max_context", 2.5),
    ("kv_budget_bytes", 1e15), ("kv_budget_bytes", 0), ("kv_budget_bytes", True),
    ("device", "tpu9"), ("device", "cuda:x"), ("device", 0),
    ("reuse", "bogus"), ("reuse", None), ("dtype", 16), ("model", 3),
    ("block_size", 16.0), ("max_num_seqs", 0), ("num_threads", 0), ("view_path", "fast"),
    ("cache_dir", 5), ("baselines", [1]), ("kvcmas", {}),
])
def test_engine_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field if field not in ("block_size", "max_num_seqs") else "positive"):
        EngineConfig(**{field: value})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    EngineConfig(device="cuda:1", max_context=128, kv_budget_bytes=2**20, dtype="bfloat16")   # valid: no error


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "0.7"}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": "1"}, "top_p"),
    ({"seed": "42"}, "seed"), ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": ["ok", 3]}, "stop"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"forced_tokens": ["a"]}, "forced_tokens"),
])
def test_sampling_params_reject_bad_values(kwargs, field):
    params = SamplingParams(**kwargs)           # constructing never raises a raw TypeError
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()


def test_sampling_params_accept_good_values():
    SamplingParams(max_tokens=1, temperature=1, top_p=0.5, top_k=3, seed=7, stop="END").validate()
    assert SamplingParams(stop="END").stop == ["END"]
