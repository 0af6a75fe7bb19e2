"""A turn-time correction computes the own tail in its recompute pass (``Corrector.fused_tail``): when
it does, what it gives up, and its fidelity on the real default model, not its time."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
from kvcmas_agents.fidelity import CSV_SYSTEM, kl
from kvcmas_agents.reuse.kvcmas import correction
from kvcmas_agents.reuse.kvcmas.correction import FUSED_TAIL_MAX, Corrector
from kvcmas_agents.reuse.storage.spec import StorageSpec

FIRST = SamplingParams(max_tokens=1, return_logits=True)


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": CSV_SYSTEM[agent]}] + history


def test_the_tail_is_fused_only_at_turn_time_in_the_models_dtype_and_within_the_cap():
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    fp32 = Corrector(SimpleNamespace(model=model), StorageSpec(), newest_whole=True)
    bf16 = Corrector(SimpleNamespace(model=model), StorageSpec(), newest_whole=True, recompute_dtype="bfloat16")

    def view(n, reuse_end, select_from=None):
        return SimpleNamespace(req=SimpleNamespace(prompt_ids=list(range(n))), reuse_end=reuse_end,
                               select_from=select_from)
    assert fp32.fused_tail(view(100, 40)) == 99                 # all but the last token: its step gives logits
    assert fp32.fused_tail(view(100, 40, select_from=30)) == 0  # ahead of time: the real tail is not known
    assert bf16.fused_tail(view(100, 40)) == 0                  # bf16 products leave the tail's prefill as it was
    assert fp32.fused_tail(view(100, 99)) == 0                  # nothing but the last token
    assert fp32.fused_tail(view(FUSED_TAIL_MAX + 41, 40)) == FUSED_TAIL_MAX + 40
    assert fp32.fused_tail(view(FUSED_TAIL_MAX + 42, 40)) == 0  # a long tail is prefilled in the engine's chunks


async def test_a_full_recompute_with_the_tail_fused_stays_exact(engine_none, csv_history):
    history = await csv_history(engine_none, turns=2)
    greedy = SamplingParams(max_tokens=16, return_logits=True)
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch="off", recompute_ratio=1.0)}))
    try:
        await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
        exact = await engine_none.generate(prompt("reviewer", history), agent="r-exact", sampling=greedy)
        full = await eng.generate(prompt("reviewer", history), agent="reviewer", sampling=greedy)
        assert full.usage.recomputed_tokens == full.usage.reused_tokens > 0
        assert eng.stats()["reuse"]["kvcmas"]["fused_tail_tokens"] > 0
        assert full.token_ids == exact.token_ids
        torch.testing.assert_close(full.logits[0], exact.logits[0], atol=2e-3, rtol=0)
    finally:
        eng.close()


async def test_the_fused_tail_is_at_least_as_close_to_exact_as_its_own_forward(engine_none, csv_history, monkeypatch):
    """The fused tail reads its context's recomputed rows as computed; its own forward read their stored
    low-rank form. Same rows recomputed either way."""
    history = await csv_history(engine_none)
    exact = {a: await engine_none.generate(prompt(a, history), agent=a + "-exact", sampling=FIRST)
             for a in ("coder", "reviewer")}
    kls, tails = {}, {}
    for cap in (FUSED_TAIL_MAX, 0):
        monkeypatch.setattr(correction, "FUSED_TAIL_MAX", cap)
        eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch="off")}))
        try:
            await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
            outs = [await eng.generate(prompt(a, history), agent=a, sampling=FIRST) for a in exact]
            kls[cap] = [kl(exact[a].logits[0], o.logits[0]) for a, o in zip(exact, outs)]
            tails[cap] = eng.stats()["reuse"]["kvcmas"]["fused_tail_tokens"]
            assert all(0 < o.usage.recomputed_tokens < o.usage.reused_tokens for o in outs)
        finally:
            eng.close()
    assert tails[0] == 0 < tails[FUSED_TAIL_MAX]
    assert kls[0] != kls[FUSED_TAIL_MAX]              # the tail really read something else
    assert max(kls[FUSED_TAIL_MAX]) < 0.01, kls
    assert sum(kls[FUSED_TAIL_MAX]) <= 1.5 * sum(kls[0]) + 1e-4, kls
