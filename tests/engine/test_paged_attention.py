"""Decode steps' RoPE, KV write and attention in one call (``PagedAttention.attend_qkv``) change no bit of
what the engine computes: alone, batched with other agents, and over a kvcmas view."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
from kvcmas_agents.engine import paged_attention
from kvcmas_agents.kernels import cpu_view
from kvcmas_agents.switches import SWITCHES

pytestmark = pytest.mark.skipif(cpu_view.load() is None, reason=str(cpu_view.unavailable()))

TASK = ("Design a rate limiter for a public HTTP API: token buckets per client, a shared store, "
        "burst limits, and what the service returns when a client is over its limit. ") * 4
AGENTS = {"planner": "You are the planner. Break the task into steps.",
          "coder": "You are the coder. Write the code for the plan.",
          "reviewer": "You are the reviewer. Point out bugs and risks."}


async def _play(on: bool, reuse: str, monkeypatch) -> tuple[list, int]:
    """Logits of a planner's turn, then the coder and reviewer at once; and how many layer calls the
    one-call path served."""
    monkeypatch.setattr(SWITCHES, "rope_write", on)
    served = 0
    real = paged_attention.PagedAttention.attend_qkv

    def counting(self, *args):
        nonlocal served
        out = real(self, *args)
        served += out is not None
        return out
    monkeypatch.setattr(paged_attention.PagedAttention, "attend_qkv", counting)
    engine = Engine(EngineConfig(model=None, device="cpu", reuse=reuse, num_threads=1,
                                 methods={"kvcmas": KVCMASConfig(prefetch="off")}))
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, return_logits=True)
    try:
        if reuse == "kvcmas":
            engine.set_edges([("planner", "coder"), ("planner", "reviewer")])
        history = [{"role": "user", "content": TASK}]
        first = await engine.generate([{"role": "system", "content": AGENTS["planner"]}] + history,
                                      agent="planner", sampling=sampling)
        history.append({"role": "user", "content": "planner: " + first.text})
        rest = await asyncio.gather(*(engine.generate([{"role": "system", "content": AGENTS[a]}] + history,
                                                      agent=a, sampling=sampling) for a in ("coder", "reviewer")))
    finally:
        await engine.aclose()
    return [first, *rest], served


@pytest.mark.parametrize("reuse", ["prefix", "kvcmas"])
async def test_one_call_decode_layers_are_bitwise_the_separate_ops(reuse, monkeypatch):
    fused, served = await _play(True, reuse, monkeypatch)
    plain, unused = await _play(False, reuse, monkeypatch)
    assert served > 0 and unused == 0
    if reuse == "kvcmas":
        assert any(o.usage.reused_tokens > 0 for o in fused[1:])       # the later agents read a view
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
