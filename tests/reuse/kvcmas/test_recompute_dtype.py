"""KVCMAS's recompute in bf16 products (``recompute_dtype``) on the real default model: fidelity
against exact prefill and the stats, not time."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
from kvcmas_agents.fidelity import CSV_SYSTEM, kl
from kvcmas_agents.reuse.kvcmas.correction import products_dtype

FIRST = SamplingParams(max_tokens=1, return_logits=True)


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": CSV_SYSTEM[agent]}] + history


def test_recompute_dtype_is_checked_and_auto_resolves_by_the_hardware():
    with pytest.raises(ValueError, match="recompute_dtype"):
        KVCMASConfig(recompute_dtype="float16")

    class Model:
        device, dtype = torch.device("cpu"), torch.float32
    amx = torch.cpu._is_amx_tile_supported()
    assert products_dtype("auto", Model) == (torch.bfloat16 if amx else torch.float32)
    assert products_dtype("bfloat16", Model) == torch.bfloat16
    assert products_dtype("model", Model) == torch.float32
    assert KVCMASConfig().recompute_dtype == "model"    # opt-in: bf16 flips greedy near-ties
    Model.dtype = torch.bfloat16                       # a bf16 model keeps its own
    assert products_dtype("auto", Model) == torch.bfloat16 == products_dtype("model", Model)


async def test_bf16_recompute_is_as_close_to_exact_as_fp32_and_the_stats_say_which_ran(engine_none, csv_history):
    engine = engine_none
    history = await csv_history(engine)
    kls = {}
    for dtype in ("model", "bfloat16"):
        eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch="off",
                                                                                  recompute_dtype=dtype)}))
        try:
            await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
            kls[dtype] = []
            for agent in ("coder", "reviewer"):
                exact = await engine.generate(prompt(agent, history), agent=agent + "-exact", sampling=FIRST)
                out = await eng.generate(prompt(agent, history), agent=agent, sampling=FIRST)
                assert 0 < out.usage.recomputed_tokens < out.usage.reused_tokens
                kls[dtype].append(kl(exact.logits[0], out.logits[0]))
            assert eng.stats()["reuse"]["kvcmas"]["recompute_products"] == {"model": "float32"}.get(dtype, dtype)
        finally:
            eng.close()
    assert kls["model"] != kls["bfloat16"]           # the products really ran in bf16
    assert max(kls["bfloat16"]) < 0.01, kls
    assert sum(kls["bfloat16"]) < 2 * sum(kls["model"]) + 1e-3, kls


async def test_a_full_recompute_stays_exact_in_bf16_products(engine_none, csv_history):
    engine = engine_none
    history = await csv_history(engine, turns=2)
    greedy = SamplingParams(max_tokens=16, return_logits=True)
    eng = Engine(EngineConfig(reuse="kvcmas",
                              methods={"kvcmas": KVCMASConfig(prefetch="off", recompute_dtype="bfloat16",
                                                              recompute_ratio=1.0)}))
    try:
        await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
        exact = await engine.generate(prompt("reviewer", history), agent="r-exact", sampling=greedy)
        full = await eng.generate(prompt("reviewer", history), agent="reviewer", sampling=greedy)
        assert full.usage.recomputed_tokens == full.usage.reused_tokens > 0
        assert full.token_ids == exact.token_ids
        torch.testing.assert_close(full.logits[0], exact.logits[0], atol=2e-3, rtol=0)
    finally:
        eng.close()
