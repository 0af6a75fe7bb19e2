"""No request fails because an optimization did: workflows that once broke KVCMAS, and requests whose
correction or reused view fails, served again as exact prefills (said in their output and the stats)."""
from __future__ import annotations

import logging

import pytest

from kvcmas_agents import Engine, EngineConfig, SamplingParams
from kvcmas_agents.kernels import cpu_view
from kvcmas_agents.reuse.kvcmas import correction
from kvcmas_agents.reuse.views import gather

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
AGENTS = ("planner", "coder", "reviewer")


@pytest.fixture(scope="module")
def kvcmas():
    engine = Engine(EngineConfig(reuse="kvcmas"))
    yield engine
    engine.close()


def _system(agent: str) -> dict:
    return {"role": "system", "content": f"You are the {agent}. Be brief."}


async def _rounds(engine: Engine, task: str, rounds: int, sampling: SamplingParams, reply=None) -> list:
    """Three agents taking turns over a growing history of "agent: reply" user messages."""
    history, outs = [{"role": "user", "content": task}], []
    for _ in range(rounds):
        for agent in AGENTS:
            out = await engine.generate([_system(agent)] + history, agent=agent, sampling=sampling)
            outs.append(out)
            history.append({"role": "user", "content": f"{agent}: {reply if reply is not None else out.text}"})
    return outs


@pytest.mark.parametrize("task, sampling, reply", [
    ("Write hello world in Python.", GREEDY, None),                   # the replies repeat each other
    ("Print 1 to 10 in Python.", GREEDY, None),
    ("Say yes.", GREEDY, "ok"),                                       # one-token replies
    ("Write hello world in Python.", SamplingParams(max_tokens=1, temperature=0.0), None),
])
async def test_workflows_with_repeated_and_tiny_replies_answer_under_kvcmas(kvcmas, task, sampling, reply,
                                                                        held_by_requests):
    """The reported reproduction (identical replies made row states of different requests start at
    different layers; the gather failed on them) and its neighbours: every turn answers, by reuse."""
    before = kvcmas.stats()["counters"]
    outs = await _rounds(kvcmas, task, 3, sampling, reply)
    after = kvcmas.stats()["counters"]
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert after["failed"] == before["failed"] and after["reuse_fallbacks"] == before["reuse_fallbacks"]
    assert any(o.usage.reused_tokens for o in outs) and all(o.fallback is None for o in outs)
    assert held_by_requests(kvcmas) == 0


async def _agent_turns(engine: Engine) -> list[list[dict]]:
    """The prompts of a short three-agent workflow whose later turns reuse (and correct) other agents' KV."""
    history, prompts = [{"role": "user", "content": "Write a Python function that adds two numbers."}], []
    for agent in AGENTS:
        prompts.append([_system(agent)] + history)
        out = await engine.generate(prompts[-1], agent=agent, sampling=GREEDY)
        history.append({"role": "user", "content": f"{agent}: {out.text}"})
    return prompts


async def test_a_failing_correction_falls_back_to_an_exact_prefill(monkeypatch, caplog, engine_none, held_by_requests):
    """A correction that raises costs the request its reuse, not its answer: it is served as an exact
    prefill (the same greedy tokens as reuse="none"), logged once, counted, and said in its output;
    the next request of the workflow still reuses."""
    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        prompts = await _agent_turns(engine)
        real, calls = correction.Corrector.correct, []

        def broken(self, view):
            calls.append(view.req.request_id)
            raise RuntimeError("injected correction fault")
        monkeypatch.setattr(correction.Corrector, "correct", broken)
        before = engine.stats()["counters"]
        with caplog.at_level(logging.WARNING, logger="kvcmas_agents.engine"):
            out = await engine.generate([_system("tester")] + prompts[-1][1:], agent="tester", sampling=GREEDY)
        assert calls, "the correction never ran: nothing was tested"
        assert out.fallback is not None and "injected correction fault" in out.fallback
        assert out.reuse == "none" and out.usage.exact_fallback
        assert out.usage.reused_tokens == out.usage.cached_tokens == out.usage.recomputed_tokens == 0
        exact = await engine_none.generate([_system("tester")] + prompts[-1][1:], agent="tester", sampling=GREEDY)
        assert out.token_ids == exact.token_ids
        after = engine.stats()["counters"]
        assert after["reuse_fallbacks"] == before["reuse_fallbacks"] + 1 and after["failed"] == before["failed"]
        assert sum("injected correction fault" in r.getMessage() for r in caplog.records) == 1
        assert held_by_requests(engine) == 0
        monkeypatch.setattr(correction.Corrector, "correct", real)
        again = await engine.generate([_system("auditor")] + prompts[-1][1:], agent="auditor", sampling=GREEDY)
        assert again.fallback is None and again.usage.reused_tokens > 0
    finally:
        engine.close()


async def test_a_view_failing_mid_decode_is_finished_exactly(monkeypatch, held_by_requests):
    """A decode step over a corrected view that raises after some tokens were streamed: the request
    recomputes its prompt and those tokens exactly and finishes; what was streamed stays its output."""
    engine = Engine(EngineConfig(reuse="kvcmas"))         # decodes over its view (decode_copy "off")
    try:
        prompts = await _agent_turns(engine)
        real, real_call, steps = gather.gathered_attention, cpu_view.rope_write_view, {"n": 0}

        def step():
            steps["n"] += 1
            if steps["n"] >= 30 * 5:               # from the 5th decode step on (30 layers a step), and on retry
                raise RuntimeError("injected view fault")

        def flaky(q, view, *args, **kwargs):
            if q.shape[0] == 1 and view.stacks:
                step()
            return real(q, view, *args, **kwargs)

        def flaky_call(qkv, *args, **kwargs):     # a decode layer's RoPE, KV write and view attention in one call
            if qkv.shape[0] == 1:
                step()
            return real_call(qkv, *args, **kwargs)
        monkeypatch.setattr(gather, "gathered_attention", flaky)
        monkeypatch.setattr(cpu_view, "rope_write_view", flaky_call)
        streamed = []
        async for delta in engine.stream([_system("tester")] + prompts[-1][1:], agent="tester", sampling=GREEDY):
            streamed.extend(delta.token_ids)
            out = delta.output or None
        assert steps["n"] >= 150, "the fault was never injected"
        assert out is not None and out.fallback is not None and "injected view fault" in out.fallback
        assert out.token_ids == streamed and len(out.token_ids) >= 5
        assert engine.stats()["counters"]["reuse_fallbacks"] == 1
        assert held_by_requests(engine) == 0
    finally:
        engine.close()


async def test_a_failing_plan_admits_the_request_as_an_exact_prefill(monkeypatch, engine_none, held_by_requests):
    """Planning reuse that raises at admission fails nothing in flight: that request is prefilled exactly."""
    from kvcmas_agents.reuse.cross_agent import CrossAgentMethod

    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        prompts = await _agent_turns(engine)

        def broken(self, req):
            raise KeyError("injected plan fault")
        monkeypatch.setattr(CrossAgentMethod, "plan", broken)
        out = await engine.generate([_system("tester")] + prompts[-1][1:], agent="tester", sampling=GREEDY)
        exact = await engine_none.generate([_system("tester")] + prompts[-1][1:], agent="tester", sampling=GREEDY)
        assert out.fallback is not None and out.fallback.startswith("plan failed") and out.reuse == "none"
        assert out.token_ids == exact.token_ids
        assert engine.stats()["counters"]["reuse_fallbacks"] == 1 and held_by_requests(engine) == 0
    finally:
        engine.close()


async def test_failing_work_ahead_of_time_is_dropped_and_requests_go_on(monkeypatch, held_by_requests):
    """Ahead-of-time corrections that raise outside the prefetcher's own guard are dropped and counted;
    the worker neither fails the requests in flight nor spins on the broken work."""
    from kvcmas_agents.reuse.kvcmas.prefetch import Prefetcher

    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        engine.set_edges([("planner", "coder"), ("coder", "reviewer")])

        def broken(self, *args):
            raise RuntimeError("injected prefetch fault")
        monkeypatch.setattr(Prefetcher, "run_one", broken)
        monkeypatch.setattr(Prefetcher, "run_for", broken)
        outs = await _rounds(engine, "Write a Python function that adds two numbers.", 2, GREEDY)
        counters = engine.stats()["counters"]
        assert counters["idle_work_failed"] >= 1, "no ahead-of-time work ran: nothing was tested"
        assert counters["failed"] == 0 and all(o.finish_reason in ("stop", "length") for o in outs)
        assert engine.stats()["reuse"]["kvcmas"]["prefetch"]["queued"] >= 1
        assert held_by_requests(engine) == 0
    finally:
        engine.close()
