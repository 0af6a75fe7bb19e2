"""RoPE realignment: exact on the real model's layer 0, query/key duality, and scaled ropes."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.model.loader import load_model
from kvcmas_agents.reuse.storage.codec import compress
from kvcmas_agents.model.llama import LlamaModel
from kvcmas_agents.reuse.realign import Realigner, refuses
from kvcmas_agents.model.rope import RotaryEmbedding, inv_frequencies, rotate
from kvcmas_agents.reuse.storage.codec import Format

CPU = torch.device("cpu")
HEAD_DIM = 64
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-attn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                  "attention_factor": 0.8},
}


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    loaded = load_model(None, device="cpu", dtype="float32")
    return LlamaModel(loaded.args, loaded.weights, max_positions=1024)


@pytest.mark.parametrize("start,delta", [(3, 0), (3, 17), (40, -37), (120, 250), (300, -200)])
def test_realignment_is_exact_on_layer_0(model, start, delta):
    """Layer-0 keys do not depend on context, so realigned keys must equal keys computed at p + delta."""
    torch.manual_seed(start)
    ids = torch.randint(0, model.args.vocab_size, (24,))
    h = model.embed(ids)
    pos = torch.arange(start, start + len(ids))
    with torch.inference_mode():
        _, k_old, _ = model.qkv(0, h, pos)
        q_new, k_new, _ = model.qkv(0, h, pos + delta)
    realigner = Realigner.from_rope(model.rope)
    moved = realigner.rotate_keys(k_old, delta)
    assert moved.shape == k_old.shape and moved.dtype == k_old.dtype
    torch.testing.assert_close(moved, k_new, rtol=0, atol=1e-4)
    if delta != 0:
        # Not vacuous: the keys really moved.
        assert (k_old - k_new).abs().max() > 0.1
    # Scores of the new-position query: rotating the query back against the old keys gives the same.
    direct = torch.einsum("thd,shd->hts", q_new[:, :3], k_new)
    via_query = torch.einsum("thd,shd->hts", realigner.rotate_queries(q_new[:, :3], delta), k_old)
    torch.testing.assert_close(via_query, direct, rtol=0, atol=1e-3)


@pytest.mark.parametrize("delta", [-513, -1, 0, 1, 7, 2048])
def test_query_rotation_is_dual_to_key_rotation(delta):
    torch.manual_seed(abs(delta))
    inv, _ = inv_frequencies(HEAD_DIM, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 4, HEAD_DIM)
    lhs = (realigner.rotate_queries(q, delta) * k).sum(-1)
    rhs = (q * realigner.rotate_keys(k, delta)).sum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-4)
    # Rotations keep norms and invert each other.
    torch.testing.assert_close(realigner.rotate_keys(k, delta).norm(dim=-1), k.norm(dim=-1))
    torch.testing.assert_close(realigner.rotate_queries(realigner.rotate_keys(k, delta), delta), k,
                               rtol=0, atol=1e-5)
    if delta != 0:
        assert not torch.allclose(realigner.rotate_keys(k, delta), k, atol=1e-3)


@pytest.mark.parametrize("case", list(SCALINGS))
@pytest.mark.parametrize("p,delta", [(5, 60), (200, -150), (90, 0)])
def test_scaled_key_realigns_to_new_position(case, p, delta):
    """Keys from the factor-carrying tables: the pure rotation moves them, the attention factor survives."""
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, SCALINGS[case], 256, 512, CPU, torch.float32)
    realigner = Realigner.from_rope(rope)
    torch.manual_seed(p)
    x = torch.randn(4, 3, HEAD_DIM)
    at = lambda pos: rotate(x, *rope.cos_sin(torch.full((4,), pos)))  # noqa: E731
    torch.testing.assert_close(realigner.rotate_keys(at(p), delta), at(p + delta), rtol=0, atol=2e-5)
    f = rope.attention_factor
    if f != 1.0 and delta != 0:
        # Rotating with the model's own table for delta would apply the factor a second time.
        wrong = rotate(at(p), rope.cos[delta] if delta > 0 else rope.cos[-delta],
                       rope.sin[delta] if delta > 0 else -rope.sin[-delta])
        assert not torch.allclose(wrong, at(p + delta), atol=1e-2)


def test_cos_sin_are_pure_and_cached():
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, SCALINGS["yarn"], 256, 64, CPU, torch.float32)
    assert rope.attention_factor > 1.0
    realigner = Realigner.from_rope(rope)
    cos, sin = realigner.cos_sin(5)
    torch.testing.assert_close(cos * cos + sin * sin, torch.ones(HEAD_DIM))
    torch.testing.assert_close(cos * rope.attention_factor, rope.cos[5])
    assert realigner.cos_sin(5)[0] is cos
    torch.testing.assert_close(realigner.cos_sin(0)[0], torch.ones(HEAD_DIM))
    small = Realigner(rope.inv_freq, max_cached=2)
    first = small.cos_sin(1)[0]
    small.cos_sin(2)
    small.cos_sin(3)
    assert small.cos_sin(1)[0] is not first


def test_bf16_keys_keep_dtype():
    inv, _ = inv_frequencies(HEAD_DIM, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    k = torch.randn(3, 2, HEAD_DIM)
    out = realigner.rotate_keys(k.bfloat16(), 33)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), realigner.rotate_keys(k, 33), rtol=0, atol=3e-2)
    with pytest.raises(ValueError, match="head_dim"):
        realigner.rotate_keys(torch.randn(3, 2, HEAD_DIM // 2), 1)


@pytest.mark.parametrize("int8", [False, True])
def test_rotate_delta_rotates_reconstructed_key_rows_without_a_copy(int8):
    torch.manual_seed(0)
    inv, _ = inv_frequencies(HEAD_DIM, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    layers, heads, nrows = 2, 3, 5
    devs = torch.randn(layers, heads, nrows, HEAD_DIM), torch.randn(layers, heads, nrows, HEAD_DIM)
    state = compress(*devs, torch.tensor([0, 2, 3, 7, 9]), 4, Format(torch.int8 if int8 else None, int8_basis=int8))
    moved = realigner.rotate_delta(realigner.rotate_delta(state, 40), 2)
    assert moved.shift == 42 and moved.k is state.k and moved.v is state.v    # shared, not copied
    with pytest.raises(ValueError, match="owe a rotation"):
        moved.dense(0)
    settled = realigner.settle(moved)
    assert settled.shift == 0 and settled.k.basis_scale is None
    for layer in range(layers):
        dk, dv = state.dense(layer)
        mk, mv = settled.dense(layer)
        torch.testing.assert_close(mk, realigner.rotate_keys(dk, 42), rtol=0, atol=1e-4)
        torch.testing.assert_close(mv, dv)
        torch.testing.assert_close(realigner.key_basis(moved).at(layer), settled.k.b[layer])
    assert not torch.allclose(settled.k.b, state.key_basis().at())
    assert realigner.settle(state) is state


@pytest.mark.parametrize("scaling,ok", [
    (None, True), ({"rope_type": "default"}, True), ({"rope_type": "linear", "factor": 2.0}, True),
    (SCALINGS["llama3"], True), (SCALINGS["yarn"], True),
    ({"rope_type": "dynamic", "factor": 2.0}, False), ({"rope_type": "longrope"}, False),
    ({"type": "dynamic", "factor": 2.0}, False), ({"rope_type": "made-up"}, False),
])
def test_refuses(scaling, ok):
    reason = refuses(scaling)
    assert (reason is None) == ok
    assert Realigner.refuses(scaling) == reason
    if not ok:
        assert isinstance(reason, str) and reason
