"""A decode step's RoPE, KV write and plain attention in one call (``cpu_decode.c``) are bitwise the torch
rotation, the store's write and the loops' attention they replace."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.kernels import cpu_view
from kvcmas_agents.model.rope import RotaryEmbedding, rotate_, signed_sin

pytestmark = pytest.mark.skipif(cpu_view.load() is None, reason=str(cpu_view.unavailable()))

HEADS, KVH, D = 9, 3, 64


def _step(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (HEADS + 2 * KVH) * D, generator=g) * 3
    rope = RotaryEmbedding(D, 10000.0, None, 4096, 4096, torch.device("cpu"), torch.float32)
    positions = torch.randint(0, 4000, (n,), generator=g)
    cos, sin = rope.cos_sin(positions)
    k_cache, v_cache = torch.randn(600, KVH, D, generator=g), torch.randn(600, KVH, D, generator=g)
    write = torch.randperm(600, generator=g)[:n]
    return qkv, cos.contiguous(), signed_sin(sin).contiguous(), k_cache, v_cache, write


@pytest.mark.parametrize("n", [1, 3])
def test_rotation_and_write_are_bitwise_torchs(n):
    qkv, cos, ssin, k_cache, v_cache, write = _step(n, n)
    want_qk = rotate_(qkv[:, :(HEADS + KVH) * D].clone().view(n, HEADS + KVH, D), cos, ssin)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(0, write, want_qk[:, HEADS:])
    want_v.index_copy_(0, write, qkv[:, (HEADS + KVH) * D:].view(n, KVH, D))

    q, out = cpu_view.rope_write(qkv, cos, ssin, k_cache, v_cache, write, HEADS)
    assert out is None
    assert torch.equal(q, want_qk[:, :HEADS])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)     # every other row untouched
    assert torch.equal(qkv[:, :(HEADS + KVH) * D].view(n, HEADS + KVH, D), want_qk)


@pytest.mark.parametrize("n,ctx", [(1, 37), (1, 530), (2, 300)])
def test_attention_in_the_same_call_is_the_loops_attention(n, ctx):
    qkv, cos, ssin, k_cache, v_cache, write = _step(n, ctx)
    others = torch.tensor([s for s in range(600) if s not in set(write.tolist())])
    slots = torch.cat([others[torch.randperm(others.numel())[:ctx - n]].sort().values, write])   # new rows last
    ref_k, ref_v, ref_qkv = k_cache.clone(), v_cache.clone(), qkv.clone()
    q_ref, _ = cpu_view.rope_write(ref_qkv, cos, ssin, ref_k, ref_v, write, HEADS)
    want = cpu_view.attention(q_ref, ref_k, ref_v, slots, 0.125)

    q, out = cpu_view.rope_write(qkv, cos, ssin, k_cache, v_cache, write, HEADS, slots, 0.125)
    assert torch.equal(q, q_ref)
    assert torch.equal(out, want)


def test_rows_it_cannot_serve_are_refused():
    qkv, cos, ssin, k_cache, v_cache, write = _step(2, 5)
    assert cpu_view.rope_write_usable(qkv, cos, k_cache, write)
    assert not cpu_view.rope_write_usable(qkv[:, ::2], cos, k_cache, write)           # not contiguous
    assert not cpu_view.rope_write_usable(qkv, cos, k_cache, write[:1])               # a slot a row
    assert not cpu_view.rope_write_usable(qkv.double(), cos, k_cache, write)          # fp32 only
