"""Random Llama-shaped models (model="random:<shape>") for GPU speed runs: shapes, seeding, errors."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.engine import Engine, EngineConfig, SamplingParams
from kvcmas_agents.model.loader import load_model
from kvcmas_agents.model.random_model import SHAPES, Shape, random_args, random_weights


def _layer_weights(s: Shape) -> int:
    """Weights of one layer: q, k, v and o projections, then the gated MLP."""
    attention = (2 * s.num_heads + 2 * s.num_kv_heads) * s.head_dim * s.hidden_size
    return attention + 3 * s.hidden_size * s.intermediate_size


def test_llama3_8b_shape_has_8b_parameters_without_building_it():
    args = random_args("random:llama3-8b", vocab_size=49152, eos_token_ids=[2])
    s = SHAPES["llama3-8b"]
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (32, 32, 8, 128)
    assert 6.5e9 < 32 * _layer_weights(s) + 2 * 49152 * 4096 < 7.5e9


def test_llama3_8b_kv_shape_keeps_8b_kv_geometry_at_a_fraction_of_the_weights():
    kv, full = SHAPES["llama3-8b-kv"], SHAPES["llama3-8b"]
    geometry = lambda s: (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta)
    assert geometry(kv) == geometry(full)
    assert _layer_weights(kv) * 10 < _layer_weights(full)


def test_weights_are_seeded_and_complete():
    args = random_args("random:tiny", vocab_size=100, eos_token_ids=[0])
    a = random_weights(args, torch.device("cpu"), torch.float32)
    b = random_weights(args, torch.device("cpu"), torch.float32)
    assert a.keys() == b.keys() and "model.layers.1.mlp.down_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.norm.weight"].eq(1).all() and 0.01 < a["lm_head.weight"].std() < 0.03


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown random model shape"):
        load_model("random:gpt-17", device="cpu")


async def test_engine_serves_a_random_model_with_the_default_tokenizer():
    engine = Engine(EngineConfig(model="random:tiny", device="cpu", reuse="kvcmas"))
    try:
        shared = {"role": "user", "content": "One shared message that both agents see in full."}
        outs = [await engine.generate([{"role": "system", "content": f"You are {a}."}, shared], agent=a,
                                      sampling=SamplingParams(max_tokens=3, ignore_eos=True)) for a in ("a", "b")]
        assert engine.model_name == "random:tiny" and engine.args.num_layers == 2
        assert [o.usage.completion_tokens for o in outs] == [3, 3]
        assert outs[1].usage.reused_tokens > 0          # cross-agent reuse runs on any Llama shape
    finally:
        await engine.aclose()
