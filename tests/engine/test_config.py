"""EngineConfig and SamplingParams reject bad values with the engine's own errors, before any work."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest

from kvcmas_agents import ConfigError, EngineConfig, InvalidRequestError, KVCMASConfig, ReuseOptions, SamplingParams
from kvcmas_agents.reuse import KVCMAS, CacheBlend, CacheBlendConfig, KVComm, KVCommConfig


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


# --- every method's settings: one ``methods`` mapping (kvcmas= and baselines= are deprecated aliases) ---


def test_methods_carry_each_methods_settings_and_defaults_are_the_methods_own(recwarn):
    cfg = EngineConfig(reuse="cacheblend", methods={"kvcmas": KVCMASConfig(rank=8, reference="chain"),
                                                    "cacheblend": CacheBlendConfig(ratio=0.2)})
    assert KVCMAS.settings_of(cfg) is cfg.methods["kvcmas"] and CacheBlend.settings_of(cfg).ratio == 0.2
    assert KVComm.settings_of(cfg) == KVCommConfig()                    # left out: its own defaults
    assert KVCMAS.settings_of(EngineConfig()) == KVCMASConfig()
    assert ReuseOptions().resolve(cfg).recompute_ratio == 0.2
    assert ReuseOptions(reuse="kvcmas").resolve(cfg) == ReuseOptions("kvcmas", 0.5, 8, "chain")
    assert ReuseOptions(reuse="naive").resolve(cfg) == ReuseOptions("naive", 0.5, 40, "home")  # none of its own
    assert cfg.kvcmas is cfg.methods["kvcmas"] and cfg.baselines == {"cacheblend": CacheBlendConfig(0.2)}
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("methods, match", [
    ({"blend": CacheBlendConfig()}, "no reuse method 'blend'"),
    ({"kvcmas": CacheBlendConfig()}, r"methods\['kvcmas'\] must be a KVCMASConfig"),
    ({"cacheblend": KVCommConfig()}, r"methods\['cacheblend'\] must be a CacheBlendConfig"),
    ({"naive": KVCMASConfig()}, r"methods\['naive'\]: 'naive' takes no settings"),
    ([("kvcmas", KVCMASConfig())], "methods must be a dict"),
])
def test_methods_reject_unknown_names_and_wrong_types(methods, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(methods=methods)


def test_the_deprecated_aliases_fold_into_methods():
    with pytest.warns(DeprecationWarning, match="methods="):
        cfg = EngineConfig(kvcmas=KVCMASConfig(rank=8))
    assert cfg.methods == {"kvcmas": KVCMASConfig(rank=8)} and cfg.kvcmas.rank == 8
    with pytest.warns(DeprecationWarning):
        cfg = EngineConfig(baselines={"kvcomm": KVCommConfig(anchors=3)})
    assert cfg.methods == {"kvcomm": KVCommConfig(anchors=3)} and KVComm.settings_of(cfg).anchors == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # default values: no warning
        assert EngineConfig(kvcmas=KVCMASConfig(), baselines={}).methods == {}
        assert dataclasses.replace(cfg, reuse="kvcomm").methods == cfg.methods   # mirrors fold to themselves
    with pytest.raises(ConfigError, match="given twice"):
        EngineConfig(kvcmas=KVCMASConfig(rank=8), methods={"kvcmas": KVCMASConfig(rank=9)})
    with pytest.raises(ConfigError, match=r"methods\['kvcomm'\] must be a KVCommConfig"):
        EngineConfig(baselines={"kvcomm": CacheBlendConfig()})
