"""Weights read from the default GGUF's blocks: they expand into the checkpoint's fp32 weights, and a
model on them gives the dense model's logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.kernels import cpu_quant
from kvcmas_agents.model import blocks
from kvcmas_agents.model.llama import LlamaModel
from kvcmas_agents.model.loader import default_gguf_path, load_model

pytestmark = pytest.mark.skipif(cpu_quant.load() is None, reason=str(cpu_quant.unavailable()))


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, device="cpu", dtype="float32")


def test_every_quantized_tensor_of_the_default_gguf_is_read(loaded):
    found, dense = blocks.read_blocks(default_gguf_path(), loaded.args, loaded.weights)
    layers = loaded.args.num_layers
    assert dense == {}
    assert sum(w.kind == "Q4_1" for w in found.values()) == 7 * layers
    assert found["lm_head.weight"] is found["model.embed_tokens.weight"]
    assert found["lm_head.weight"].kind == "Q8_0"
    q = found["model.layers.0.self_attn.q_proj.weight"]       # its rows come back in HF's rope order
    assert torch.equal(q.expand(), loaded.weights["model.layers.0.self_attn.q_proj.weight"])
    assert q.block_bytes * 6 < q.dense.numel() * 4


def test_blocks_that_do_not_expand_into_the_weight_stay_dense(loaded):
    weights = dict(loaded.weights)
    name = "model.layers.3.mlp.up_proj.weight"
    weights[name] = weights[name] * 1.0001
    found, dense = blocks.read_blocks(default_gguf_path(), loaded.args, weights)
    assert name not in found and "do not expand" in dense[name]


def test_choose_says_what_serves(loaded):
    gguf = str(default_gguf_path())
    found, said = blocks.choose("auto", gguf, loaded.args, loaded.weights)
    assert found and said.startswith("blocks (Q4_1 x210, Q8_0 x1")
    assert blocks.choose("dense", gguf, loaded.args, loaded.weights) == ({}, "dense: asked for")
    none, why = blocks.choose("auto", "/no/such/model", loaded.args, loaded.weights)
    assert none == {} and why == "dense: the checkpoint is not a GGUF"
    with pytest.raises(ValueError, match="weights='blocks' cannot serve"):
        blocks.choose("blocks", None, loaded.args, loaded.weights)


def _greedy(model: LlamaModel, ids: list[int], steps: int, forced: list[int] | None = None
            ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits, one token a step after the prompt (``forced``: feed these
    tokens instead of the model's own, to compare logits along one path)."""
    from kvcmas_agents.model.attention import sdpa

    keys: list[list[torch.Tensor]] = [[] for _ in range(model.args.num_layers)]
    vals: list[list[torch.Tensor]] = [[] for _ in range(model.args.num_layers)]

    def attend(layer, q, k, v):
        keys[layer].append(k)
        vals[layer].append(v)
        return sdpa(q, torch.cat(keys[layer]), torch.cat(vals[layer]), model.scale)

    tokens, logits, pos, step = [], [], 0, list(ids)
    with torch.inference_mode():
        for i in range(steps):
            positions = torch.arange(pos, pos + len(step))
            out = model.logits(model.forward(torch.tensor(step), positions, attend)[-1:])
            pos += len(step)
            logits.append(out[0])
            tokens.append(int(out[0].argmax()))
            step = [forced[i] if forced else tokens[-1]]
    return tokens, logits


PROMPT = "The capital of France is"


def test_a_model_on_blocks_decodes_as_the_dense_one(loaded):
    """Decode-sized steps read the blocks with fp32 rows, wide ones the dense weights: logits agree to
    fp32 rounding of the sums and greedy tokens are the same."""
    found, said = blocks.choose("blocks", str(default_gguf_path()), loaded.args, loaded.weights)
    assert "fp32 rows" in said
    on_blocks = LlamaModel(loaded.args, loaded.weights, 256, found)
    dense = LlamaModel(loaded.args, loaded.weights, 256)
    assert on_blocks.block_bytes > 0 and dense.block_bytes == 0
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    got, got_logits = _greedy(on_blocks, ids, 12)
    want, want_logits = _greedy(dense, ids, 12)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert (a - b).abs().max() < 2e-3


def test_int8_rows_keep_the_dense_models_choices(loaded):
    """int8 rows (llama.cpp's rounding of the activations) move the logits by a little: along the dense
    model's own greedy path, the int8 model picks the same token wherever the dense model's choice is
    clear (a margin of half a logit over the next token; measured disagreements sat at margins of
    0.002-0.47), most tokens overall, and its logits stay close but not equal (the rounding is real)."""
    found, said = blocks.choose("int8", str(default_gguf_path()), loaded.args, loaded.weights)
    assert "int8 rows" in said
    on_int8 = LlamaModel(loaded.args, loaded.weights, 256, found)
    dense = LlamaModel(loaded.args, loaded.weights, 256)
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    want, want_logits = _greedy(dense, ids, 32)
    got, got_logits = _greedy(on_int8, ids, 32, forced=want)
    assert got[0] == want[0]                          # the first token comes from the dense prefill
    assert sum(a == b for a, b in zip(got, want)) >= 27
    for mine, theirs, a, b in zip(got, want, got_logits, want_logits):
        top = b.topk(2).values
        assert mine == theirs or top[0] - top[1] < 0.5
    for a, b in zip(got_logits[1:], want_logits[1:]):
        assert 0 < (a - b).abs().max() < 0.15 * (b.max() - b.min())
