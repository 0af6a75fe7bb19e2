"""RoPE: our inverse frequencies and rotation against transformers' own implementation.

The reference values come from the installed transformers (``ROPE_INIT_FUNCTIONS`` and the Llama
rotary module), so a drift in either side shows up here.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvcmas_agents.model.args import ModelArgs
from kvcmas_agents.model.rope import SUPPORTED_SCALINGS, RotaryEmbedding, inv_frequencies, rotate, rotate_, signed_sin

HEAD_DIM = 64
HIDDEN = 256          # 4 heads of HEAD_DIM
MAX_POS = 256

# Each case: rope_parameters as transformers 5 spells them (rope_theta inside).
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default-1e6": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128, "rope_theta": 500000.0},
    "llama3-odd": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                   "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn-no-orig": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                  "rope_theta": 10000.0, "attention_factor": 0.8},
}


def _hf_config(rope_parameters: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=128, num_hidden_layers=1, vocab_size=32,
                       max_position_embeddings=MAX_POS, rope_parameters=dict(rope_parameters))


def _hf_inv_freq(rope_parameters: dict) -> tuple[torch.Tensor, float]:
    cfg = _hf_config(rope_parameters)
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        inv, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return inv, float(factor)


def _our_scaling(rope_parameters: dict) -> dict | None:
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return None if scaling.get("rope_type") == "default" else scaling


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_inv_frequencies_match_transformers(case):
    rp = ROPE_CASES[case]
    hf_inv, hf_factor = _hf_inv_freq(rp)
    ours, factor = inv_frequencies(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS)
    assert ours.shape == (HEAD_DIM // 2,)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours.float(), hf_inv.float(), rtol=1e-6, atol=0.0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_scalings_really_change_frequencies():
    """Guard against a vacuous comparison: each scaling differs from the unscaled table."""
    base, _ = inv_frequencies(HEAD_DIM, 10000.0, None, MAX_POS)
    for case in ("linear", "llama3-odd", "yarn"):
        rp = ROPE_CASES[case]
        scaled, _ = inv_frequencies(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS)
        assert not torch.allclose(scaled, base), case
    # Explicit "default" scaling dict is the same as no scaling.
    explicit, factor = inv_frequencies(HEAD_DIM, 10000.0, {"rope_type": "default"}, MAX_POS)
    assert torch.equal(explicit, base) and factor == 1.0
    # Yarn's default attention factor is 0.1 * ln(factor) + 1.
    _, yarn_factor = inv_frequencies(HEAD_DIM, 10000.0, _our_scaling(ROPE_CASES["yarn"]), MAX_POS)
    assert yarn_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "made-up"])
def test_unsupported_scalings_raise(kind):
    scaling = {"rope_type": kind, "factor": 2.0, "short_factor": [1.0] * 32, "long_factor": [1.0] * 32,
               "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match=kind):
        inv_frequencies(HEAD_DIM, 10000.0, scaling, MAX_POS)
    with pytest.raises(ValueError):
        RotaryEmbedding(HEAD_DIM, 10000.0, scaling, MAX_POS, 16, torch.device("cpu"), torch.float32)
    assert kind not in SUPPORTED_SCALINGS


@pytest.mark.parametrize("case", ["default", "llama3", "yarn", "yarn-attn"])
def test_rotary_tables_match_hf_module(case):
    """Our cos/sin tables (attention factor included) equal LlamaRotaryEmbedding's output."""
    rp = ROPE_CASES[case]
    hf = LlamaRotaryEmbedding(_hf_config(rp))
    ours = RotaryEmbedding(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS, MAX_POS,
                           torch.device("cpu"), torch.float32)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions)
    assert cos.shape == (len(positions), 1, HEAD_DIM)
    torch.testing.assert_close(cos[:, 0], cos_hf[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[:, 0], sin_hf[0], rtol=0, atol=2e-5)
    assert ours.attention_factor == pytest.approx(hf.attention_scaling)


@pytest.mark.parametrize("case", ["default", "linear", "llama3", "yarn"])
def test_rotate_matches_apply_rotary_pos_emb(case):
    rp = ROPE_CASES[case]
    torch.manual_seed(0)
    t, heads = 9, 3
    rope = RotaryEmbedding(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS, MAX_POS,
                           torch.device("cpu"), torch.float32)
    positions = torch.tensor([0, 1, 2, 17, 64, 100, 128, 200, 255])
    x = torch.randn(t, heads, HEAD_DIM)
    cos, sin = rope.cos_sin(positions)
    ours = rotate(x, cos, sin)

    # HF layout: [batch, heads, seq, dim] with cos/sin [batch, seq, dim].
    xh = x.transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(xh, xh.clone(), cos[:, 0][None], sin[:, 0][None])
    ref = q_ref[0].transpose(0, 1)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, k_ref[0].transpose(0, 1), rtol=0, atol=1e-6)
    # Position 0 with no attention factor is the identity; other positions really move x.
    if rope.attention_factor == 1.0:
        torch.testing.assert_close(ours[0], x[0])
    assert not torch.allclose(ours[3], x[3], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_in_place_is_bitwise_rotate(dtype):
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None, MAX_POS, MAX_POS, torch.device("cpu"), dtype)
    torch.manual_seed(1)
    positions = torch.tensor([0, 3, 77, 200, 255])
    x = torch.randn(5, 3, HEAD_DIM, dtype=dtype)
    cos, sin = rope.cos_sin(positions)
    expected = rotate(x, cos, sin)
    work = x.clone()
    out = rotate_(work, cos, signed_sin(sin))
    assert out is work                                    # in place
    assert torch.equal(out, expected)                     # same roundings, not just close
    assert not torch.equal(out, x)


def _pure_cos_sin(inv: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = pos * inv
    emb = torch.cat([angles, angles])
    return emb.cos().view(1, 1, -1), emb.sin().view(1, 1, -1)


@pytest.mark.parametrize("case", ["default", "linear", "llama3", "yarn"])
@pytest.mark.parametrize("a,b", [(0, 7), (5, 11), (37, 500), (1000, 2345)])
def test_rotation_composes_exactly_fp64(case, a, b):
    """R(b) R(a) x == R(a + b) x for the pure rotation: what moving cached keys by a delta relies on."""
    rp = ROPE_CASES[case]
    inv, _ = inv_frequencies(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS)
    torch.manual_seed(a + b)
    x = torch.randn(1, 4, HEAD_DIM, dtype=torch.float64)
    twice = rotate(rotate(x, *_pure_cos_sin(inv, a)), *_pure_cos_sin(inv, b))
    once = rotate(x, *_pure_cos_sin(inv, a + b))
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-9)
    # Rotation preserves norms, and rotating back by -a undoes a rotation by a.
    torch.testing.assert_close(once.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    back = rotate(rotate(x, *_pure_cos_sin(inv, a)), *_pure_cos_sin(inv, -a))
    torch.testing.assert_close(back, x, rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["default", "llama3", "yarn"])
def test_rotation_composes_with_fp32_tables(case):
    """The same property over the engine's fp32 tables (attention factor divided out)."""
    rp = ROPE_CASES[case]
    rope = RotaryEmbedding(HEAD_DIM, rp["rope_theta"], _our_scaling(rp), MAX_POS, 2048,
                           torch.device("cpu"), torch.float32)
    f = rope.attention_factor
    torch.manual_seed(1)
    x = torch.randn(6, 2, HEAD_DIM)
    a = torch.tensor([0, 3, 40, 128, 700, 1000])
    b = torch.tensor([9, 0, 77, 300, 45, 1047])
    ca, sa = rope.cos_sin(a)
    cb, sb = rope.cos_sin(b)
    cab, sab = rope.cos_sin(a + b)
    twice = rotate(rotate(x, ca / f, sa / f), cb / f, sb / f)
    once = rotate(x, cab / f, sab / f)
    torch.testing.assert_close(twice, once, rtol=0, atol=2e-3)
    # Rotating twice with the factor-carrying tables scales by f**2, so it is the pure rotation that composes.
    if f != 1.0:
        assert not torch.allclose(rotate(rotate(x, ca, sa), cb, sb), once, atol=1e-2)


# ------------------------------------------------------------------------- ModelArgs.from_hf_config

BASE_CFG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_from_hf_config_transformers5_style():
    cfg = dict(BASE_CFG, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
                                          "rope_theta": 500000.0})
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    assert args.head_dim == 16 and args.num_kv_heads == 2
    # The config dict is not mutated.
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0


def test_from_hf_config_transformers5_default_rope_is_none():
    args = ModelArgs.from_hf_config(dict(BASE_CFG, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert args.rope_theta == 1e6
    assert args.rope_scaling is None


def test_from_hf_config_old_style():
    cfg = dict(BASE_CFG, rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 2.0})
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == 50000.0
    assert args.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg["rope_scaling"] == {"type": "linear", "factor": 2.0}      # input left alone
    # Old style with rope_type key and no scaling at all.
    args = ModelArgs.from_hf_config(dict(BASE_CFG, rope_theta=123.0, rope_scaling=None))
    assert args.rope_theta == 123.0 and args.rope_scaling is None
    args = ModelArgs.from_hf_config(dict(BASE_CFG, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert args.rope_theta == 10000.0
    assert args.rope_scaling == {"rope_type": "yarn", "factor": 4.0}


@pytest.mark.parametrize("style", ["new", "old"])
def test_from_hf_config_via_transformers_config_objects(style):
    """Round trip through a real LlamaConfig.to_dict(), whichever way the rope was given."""
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if style == "new":
        cfg = LlamaConfig(**kw, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})
    else:
        cfg = LlamaConfig(**kw, rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 2.0})
    args = ModelArgs.from_hf_config(cfg.to_dict())
    assert args.rope_theta == 50000.0
    assert args.rope_scaling is not None
    assert args.rope_scaling["rope_type"] == "linear" and args.rope_scaling["factor"] == 2.0
    assert "type" not in args.rope_scaling and "rope_theta" not in args.rope_scaling
    inv, factor = inv_frequencies(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    torch.testing.assert_close(inv.float(), hf_inv.float(), rtol=1e-6, atol=0.0)
    assert factor == hf_factor


def test_from_hf_config_rejects_unknown_arch():
    with pytest.raises(ValueError, match="gemma"):
        ModelArgs.from_hf_config(dict(BASE_CFG, model_type="gemma"))
