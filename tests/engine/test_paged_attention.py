"""Decode steps' RoPE, KV write and attention in one call (``PagedAttention.attend_qkv``) change no bit of
what the engine computes: alone, over kvcmas views, and for several sequences in one step."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.engine import paged_attention
from kvcmas_agents.engine.paged_attention import PagedAttention, SeqSlice
from kvcmas_agents.kernels import cpu_view
from kvcmas_agents.model.rope import RotaryEmbedding, rotate_, signed_sin
from kvcmas_agents.switches import SWITCHES

pytestmark = pytest.mark.skipif(cpu_view.load() is None, reason=str(cpu_view.unavailable()))

TASK = ("Design a rate limiter for a public HTTP API: token buckets per client, a shared store, "
        "burst limits, and what the service returns when a client is over its limit. ") * 4
AGENTS = {"planner": "You are the planner. Break the task into steps.",
          "coder": "You are the coder. Write the code for the plan.",
          "reviewer": "You are the reviewer. Point out bugs and risks."}


async def _play(on: bool, reuse: str, monkeypatch) -> tuple[list, int, int]:
    """Logits of two rounds of three agents, one at a time (concurrent requests would be batched as they
    happen to arrive, which moves rounding: tested below on the backend itself), the second round's
    views of several stacks; how many layer calls the one-call path served, and how many of them over a
    view."""
    monkeypatch.setattr(SWITCHES, "rope_write", on)
    served = views = 0
    real, real_view = paged_attention.PagedAttention.attend_qkv, cpu_view.rope_write_view

    def counting(self, *args):
        nonlocal served
        out = real(self, *args)
        served += out is not None
        return out

    def counting_view(*args):
        nonlocal views
        views += 1
        return real_view(*args)
    monkeypatch.setattr(paged_attention.PagedAttention, "attend_qkv", counting)
    monkeypatch.setattr(cpu_view, "rope_write_view", counting_view)
    engine = Engine(EngineConfig(model=None, device="cpu", reuse=reuse, num_threads=1,
                                 methods={"kvcmas": KVCMASConfig(prefetch="off")}))
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, return_logits=True)
    try:
        if reuse == "kvcmas":
            engine.set_edges([("planner", "coder"), ("planner", "reviewer")])
        history, outs = [{"role": "user", "content": TASK}], []
        for _ in range(2):
            for a in AGENTS:
                outs.append(await engine.generate([{"role": "system", "content": AGENTS[a]}] + history, agent=a,
                                                  sampling=sampling))
                history.append({"role": "user", "content": f"{a}: {outs[-1].text}"})
    finally:
        await engine.aclose()
    return outs, served, views


@pytest.mark.parametrize("reuse", ["prefix", "kvcmas"])
async def test_one_call_decode_layers_are_bitwise_the_separate_ops(reuse, monkeypatch):
    fused, served, views = await _play(True, reuse, monkeypatch)
    plain, unused, _ = await _play(False, reuse, monkeypatch)
    assert served > 0 and unused == 0
    if reuse == "kvcmas":
        assert all(o.usage.reused_tokens > 0 for o in fused[1:])       # the later turns read views
        assert views > 0
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_several_sequences_in_one_step_are_bitwise_the_separate_ops():
    """Three sequences' rows in one step (two decoding over plain KV, one with two rows): each attends
    over its own context after all rows are stored, as ``__call__`` does it."""
    heads, kvh, d = 9, 3, 64
    g = torch.Generator().manual_seed(3)
    stores = [KVStore(2, kvh, d, 16, 2 * 2 * 16 * kvh * d * 4 * 40, torch.device("cpu"), torch.float32)
              for _ in range(2)]
    base_k, base_v = torch.randn(stores[0].k.shape, generator=g), torch.randn(stores[0].v.shape, generator=g)
    for st in stores:
        st.k.copy_(base_k)
        st.v.copy_(base_v)
    write = torch.tensor([40, 90, 300, 301])
    slices = [SeqSlice(0, 1, torch.cat([torch.arange(0, 40), write[:1]])),
              SeqSlice(1, 2, torch.cat([torch.arange(50, 90), write[1:2]])),
              SeqSlice(2, 4, torch.cat([torch.arange(200, 300), write[2:]]))]
    qkv = torch.randn(4, (heads + 2 * kvh) * d, generator=g)
    rope = RotaryEmbedding(d, 10000.0, None, 4096, 4096, torch.device("cpu"), torch.float32)
    cos, sin = rope.cos_sin(torch.tensor([40, 40, 100, 101]))
    cos, ssin = cos.contiguous(), signed_sin(sin).contiguous()

    qk = rotate_(qkv[:, :(heads + kvh) * d].clone().view(4, heads + kvh, d), cos, ssin)
    v = qkv[:, (heads + kvh) * d:].view(4, kvh, d)
    want = PagedAttention(stores[0], slices, write, 0.125)(1, qk[:, :heads], qk[:, heads:], v)
    got = PagedAttention(stores[1], slices, write, 0.125).attend_qkv(1, qkv, cos, ssin)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(stores[0].k, stores[1].k) and torch.equal(stores[0].v, stores[1].v)
