"""Our functional LlamaModel against transformers, and paged attention against contiguous attention.

Covers the real default checkpoint and tiny random Llama (q/k/v/o biases), Qwen2 (q/k/v biases,
tied embeddings) and Mistral models, plus chunked prefill and mixed batches over the paged KV store.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from kvcmas_agents.engine.paged_attention import PagedAttention, SeqSlice
from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.model.loader import load_model
from kvcmas_agents.model.llama import LlamaModel, linear
from kvcmas_agents.model.args import ModelArgs

CPU = torch.device("cpu")


class ContiguousAttention:
    """Reference backend: per-layer growing K/V lists, explicit causal softmax attention with GQA."""

    def __init__(self, num_layers: int, scale: float):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(k)
        self.v[layer].append(v)
        kc, vc = torch.cat(self.k[layer]), torch.cat(self.v[layer])      # [ctx, KVH, D]
        n, heads = q.shape[0], q.shape[1]
        ctx, kv_heads = kc.shape[0], kc.shape[1]
        group = heads // kv_heads
        kh = kc.repeat_interleave(group, dim=1).transpose(0, 1)           # [H, ctx, D]
        vh = vc.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ kh.transpose(1, 2)) * self.scale     # [H, n, ctx]
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > qpos, float("-inf"))
        return (scores.softmax(-1) @ vh).transpose(0, 1)                  # [n, H, D]


def run_contiguous(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    attn = ContiguousAttention(model.args.num_layers, model.scale)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), attn)
        return model.logits(hidden)


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


# --------------------------------------------------------------------------- real default model


@pytest.fixture(scope="module")
def real():
    loaded = load_model(None, device="cpu", dtype="float32")
    model = LlamaModel(loaded.args, loaded.weights, max_positions=512)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    messages = [
        {"role": "system", "content": "You are a concise assistant that helps a team of software agents."},
        {"role": "user", "content": "Name the capital of France and one famous museum there, in one sentence."},
    ]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    # One contiguous pass, shared by the tests below (a forward is ~1 s on a small CPU).
    return loaded, model, hf, ids, run_contiguous(model, ids)


def test_real_model_matches_transformers(real):
    loaded, model, hf, ids, ours = real
    assert 30 <= len(ids) <= 60
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (len(ids), loaded.args.vocab_size)
    assert ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_real_model_paged_chunked_prefill(real):
    """Three prefill chunks over a paged store give the single-pass logits."""
    loaded, model, _, ids, full = real
    store = KVStore(model.args.num_layers, model.args.num_kv_heads, model.args.head_dim, block_size=8,
                    budget_bytes=16 * 2 * model.args.num_layers * 8 * model.args.num_kv_heads
                    * model.args.head_dim * 4, device=CPU, dtype=torch.float32)
    blocks = _scrambled_blocks(store, len(ids))
    n = len(ids)
    bounds = [0, n // 3 + 1, 2 * n // 3 + 2, n]
    last = None
    for s, e in zip(bounds, bounds[1:]):
        out = _paged_step(model, store, [(ids, blocks, s, e)])
        torch.testing.assert_close(out, full[s:e], rtol=0, atol=1e-4)
        last = out[-1]
    torch.testing.assert_close(last, full[-1], rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- tiny random models

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _tiny_llama_bias() -> LlamaConfig:
    # attention_bias=True puts biases on q/k/v *and* o_proj; llama3 rope scaling exercises the tables.
    return LlamaConfig(**TINY, num_hidden_layers=3, attention_bias=True, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                        "rope_theta": 10000.0})


def _tiny_qwen2() -> Qwen2Config:
    return Qwen2Config(**TINY, num_hidden_layers=2, tie_word_embeddings=True, use_sliding_window=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "rope_theta": 10000.0})


def _tiny_mistral() -> MistralConfig:
    return MistralConfig(**TINY, num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})


TINY_CONFIGS = {"llama-bias": _tiny_llama_bias, "qwen2": _tiny_qwen2, "mistral": _tiny_mistral}


def _randomize(hf_model, seed: int) -> None:
    """HF initialises biases to zero and norms to one; make every parameter matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def build_tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[kind]()
    cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(hf, seed)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    args = ModelArgs.from_hf_config(cfg.to_dict())
    return hf, LlamaModel(args, weights, max_positions=256), args


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request):
    hf, model, args = build_tiny(request.param)
    return request.param, hf, model, args


def _ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_tiny_args_reflect_architecture(tiny):
    kind, hf, model, args = tiny
    assert args.model_type == {"llama-bias": "llama", "qwen2": "qwen2", "mistral": "mistral"}[kind]
    assert args.attention_bias == (kind in ("llama-bias", "qwen2"))
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (4, 2, 16)
    assert model._layers[0]["q_b"] is not None if args.attention_bias else model._layers[0]["q_b"] is None
    assert (model._layers[0]["o_b"] is not None) == (kind == "llama-bias")
    if kind == "qwen2":
        assert args.tie_word_embeddings and args.rope_scaling["rope_type"] == "yarn"
        assert model.rope.attention_factor > 1.0


def test_tiny_logits_match_transformers(tiny):
    kind, hf, model, args = tiny
    ids = _ids(50, seed=1)
    ours = run_contiguous(model, ids)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0          # weights are large enough that mistakes would show
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, (kind, diff)


@pytest.mark.parametrize("kind", ["llama-bias", "qwen2"])
def test_biases_are_used(kind):
    """Dropping the attention biases changes the logits, so the comparison above covers them."""
    hf, model, args = build_tiny(kind)
    ids = _ids(20, seed=2)
    ref = run_contiguous(model, ids)
    stripped = {k: v for k, v in model.w.items() if not k.endswith("_proj.bias")}
    assert len(stripped) < len(model.w)
    other = run_contiguous(LlamaModel(args, stripped, max_positions=64), ids)
    assert (other - ref).abs().max() > 1e-2


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_projection_is_f_linear_and_its_heads_split_alike(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 48, generator=g), torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    ref = torch.nn.functional.linear(x, w, b)
    out = linear(x, w, b)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
    assert out.is_contiguous()          # heads split off it keep the layout attention's fused kernels take
    from kvcmas_agents import switches
    with switches.off("cpu_matmul"):
        assert torch.equal(linear(x, w, b), ref)
    assert switches.SWITCHES.cpu_matmul


# --------------------------------------------------------------------------- paged attention


def _scrambled_blocks(store: KVStore, num_tokens: int, seed: int = 0) -> list[int]:
    """Allocate enough blocks for num_tokens, in a non-contiguous, shuffled order."""
    need = -(-num_tokens // store.block_size)
    pool = [store.allocate() for _ in range(min(store.num_available, 2 * need))]
    random.Random(seed).shuffle(pool)
    keep, drop = pool[:need], pool[need:]
    for b in drop:
        store.decref(b, cached=False)
    return keep


def _paged_step(model: LlamaModel, store: KVStore, parts) -> torch.Tensor:
    """One flat step: parts are (ids, blocks, start, end); returns logits for all new tokens."""
    tokens, positions, write, slices = [], [], [], []
    offset = 0
    for ids, blocks, s, e in parts:
        tokens.extend(ids[s:e])
        positions.append(torch.arange(s, e))
        write.append(store.slots(blocks, s, e))
        slices.append(SeqSlice(offset, offset + e - s, store.slots(blocks, 0, e)))
        offset += e - s
    attn = PagedAttention(store, slices, torch.cat(write), model.scale)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(tokens), torch.cat(positions), attn)
        return model.logits(hidden)


def _tiny_store(args: ModelArgs, num_blocks: int = 32, block_size: int = 4) -> KVStore:
    block_bytes = 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * 4
    return KVStore(args.num_layers, args.num_kv_heads, args.head_dim, block_size, num_blocks * block_bytes,
                   CPU, torch.float32)


def test_paged_single_chunk_matches_contiguous(tiny):
    _, _, model, args = tiny
    ids = _ids(23, seed=3)
    store = _tiny_store(args)
    blocks = _scrambled_blocks(store, len(ids))
    torch.testing.assert_close(_paged_step(model, store, [(ids, blocks, 0, len(ids))]),
                               run_contiguous(model, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bounds", [(0, 7, 15, 23), (0, 1, 2, 23), (0, 21, 22, 23)])
def test_chunked_prefill_matches_one_chunk(tiny, bounds):
    _, _, model, args = tiny
    ids = _ids(23, seed=4)
    store = _tiny_store(args)
    blocks = _scrambled_blocks(store, len(ids))
    store_one = _tiny_store(args)
    one = _paged_step(model, store_one, [(ids, _scrambled_blocks(store_one, 23, seed=9), 0, 23)])
    outs = [_paged_step(model, store, [(ids, blocks, s, e)]) for s, e in zip(bounds, bounds[1:])]
    assert [o.shape[0] for o in outs] == [e - s for s, e in zip(bounds, bounds[1:])]
    torch.testing.assert_close(outs[-1][-1], one[-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), one, rtol=0, atol=1e-4)


def test_chunk_with_wrong_context_differs(tiny):
    """Sanity: a second chunk that cannot see the first chunk's KV gives different logits."""
    _, _, model, args = tiny
    ids = _ids(16, seed=5)
    store = _tiny_store(args)
    blocks = _scrambled_blocks(store, 16)
    full = _paged_step(model, store, [(ids, blocks, 0, 16)])
    # Same tokens at the same positions, but with only themselves as context.
    fresh = _tiny_store(args)
    fblocks = _scrambled_blocks(fresh, 16)
    tokens = ids[8:]
    write = fresh.slots(fblocks, 0, 8)
    attn = PagedAttention(fresh, [SeqSlice(0, 8, write)], write, model.scale)
    with torch.inference_mode():
        alone = model.logits(model.forward(torch.tensor(tokens), torch.arange(8, 16), attn))
    assert (alone - full[8:]).abs().max() > 1e-2


def test_batch_of_two_matches_each_alone(tiny):
    _, _, model, args = tiny
    a, b = _ids(13, seed=6), _ids(6, seed=7)
    alone_a = run_contiguous(model, a)
    alone_b = run_contiguous(model, b)
    store = _tiny_store(args)
    ba, bb = _scrambled_blocks(store, len(a), seed=1), _scrambled_blocks(store, len(b), seed=2)
    assert not set(ba) & set(bb)
    out = _paged_step(model, store, [(a, ba, 0, len(a)), (b, bb, 0, len(b))])
    assert out.shape[0] == len(a) + len(b)
    torch.testing.assert_close(out[:len(a)], alone_a, rtol=0, atol=1e-4)
    torch.testing.assert_close(out[len(a):], alone_b, rtol=0, atol=1e-4)


def test_mixed_decode_and_prefill_step(tiny):
    """A decode token of one sequence and a mid-prompt chunk of another in one flat step."""
    _, _, model, args = tiny
    a, b = _ids(10, seed=8), _ids(12, seed=9)
    ref_a, ref_b = run_contiguous(model, a), run_contiguous(model, b)
    store = _tiny_store(args)
    ba, bb = _scrambled_blocks(store, len(a), seed=3), _scrambled_blocks(store, len(b), seed=4)
    first = _paged_step(model, store, [(a, ba, 0, 9), (b, bb, 0, 5)])
    torch.testing.assert_close(first[:9], ref_a[:9], rtol=0, atol=1e-4)
    torch.testing.assert_close(first[9:], ref_b[:5], rtol=0, atol=1e-4)
    second = _paged_step(model, store, [(a, ba, 9, 10), (b, bb, 5, 12)])
    torch.testing.assert_close(second[0], ref_a[9], rtol=0, atol=1e-4)
    torch.testing.assert_close(second[1:], ref_b[5:], rtol=0, atol=1e-4)


def test_products_round_only_wide_products_and_only_inside_the_block(tiny):
    """``products(bf16)``: a prefill-sized forward moves by bf16 rounding, a decode-sized one (up to the
    blocks' MAX_ROWS rows) not at all, and the model's own precision comes back after the block."""
    kind, hf, model, args = tiny
    ids = torch.tensor(_ids(24, seed=5))
    pos = torch.arange(24)

    def hidden(n):
        return model.forward(ids[:n], pos[:n], ContiguousAttention(args.num_layers, model.scale))
    wide, narrow = hidden(24), hidden(4)
    with model.products(torch.bfloat16):
        assert model.wide_dtype == torch.bfloat16
        wide_bf, narrow_bf = hidden(24), hidden(4)
        with model.products(model.dtype):         # the model's own dtype: nothing rounded
            assert model.wide_dtype is None
        assert model.wide_dtype == torch.bfloat16
    assert model.wide_dtype is None
    assert narrow_bf.equal(narrow)
    assert not wide_bf.equal(wide)
    torch.testing.assert_close(wide_bf, wide, rtol=0, atol=0.1 * float(wide.abs().max()))
    assert hidden(24).equal(wide)
