"""Property-based: random multi-agent workflows on the real default model, under every main reuse mode.

A workflow is 2-5 agents with their own system prompts taking turns (one after another, or a round's
agents at once) over a growing history: model replies, replies repeated verbatim, empty-looking and
one-token replies, assistant tool calls with their tool results; ``max_tokens`` 1-64; agents declared
or not. Each asserts that every request answers, that no request needed the exact fallback (a reuse
failure would hide behind it), that the exact modes give the same greedy tokens as the same prompt run
alone without reuse, and that once a workflow ends the requests hold no KV.

CI runs a few examples per mode. The soak runs thousands (not in CI):

    KVCMAS_WORKFLOW_EXAMPLES=2000 KVCMAS_WORKFLOW_SEED=random .venv/bin/python -m pytest -q \
        tests/engine/test_random_workflows.py -p no:cacheprovider --timeout 0
"""
from __future__ import annotations

import asyncio
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcmas_agents import Engine, EngineConfig, SamplingParams

EXAMPLES = int(os.environ.get("KVCMAS_WORKFLOW_EXAMPLES", "4"))
RANDOM = os.environ.get("KVCMAS_WORKFLOW_SEED") == "random"     # CI draws the same examples every run
NAMES = ["planner", "coder", "reviewer", "tester", "writer"]
TASKS = ["Write a Python function that adds two numbers.", "Write hello world in Python.",
         "Say yes.", "List three colors.", "Reverse a string in Python."]
# How a turn's message enters the shared history.
REPLIES = ["model", "model", "repeat", "empty", "one_token", "tool"]
EMPTY_LOOKING = [" ", "\n", "...", "-", "``` ```"]


@st.composite
def workflows(draw) -> dict:
    n = draw(st.integers(2, 5))
    agents = NAMES[:n]
    rounds = draw(st.integers(1, 2))
    turns = [[{"reply": draw(st.sampled_from(REPLIES)),
               "max_tokens": draw(st.one_of(st.integers(1, 8), st.integers(9, 64))),
               "filler": draw(st.sampled_from(EMPTY_LOOKING))} for _ in agents] for _ in range(rounds)]
    return {"agents": agents, "task": draw(st.sampled_from(TASKS)), "turns": turns,
            "brief": draw(st.booleans()), "declare": draw(st.booleans()), "concurrent": draw(st.booleans())}


def _system(agent: str, brief: bool) -> dict:
    return {"role": "system", "content": f"You are the {agent}." + (" Be brief." if brief else "")}


def _history_entry(agent: str, turn: dict, text: str, previous: str | None, i: int) -> list[dict]:
    """What the agent's turn adds to the shared history."""
    kind = turn["reply"]
    if kind == "repeat" and previous is not None:
        text = previous
    elif kind == "empty":
        text = turn["filler"]
    elif kind == "one_token":
        text = "ok"
    elif kind == "tool":
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": i, "b": 2})}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": str(i + 2)}]
    return [{"role": "user", "content": f"{agent}: {text}"}]


async def _run(engine: Engine, flow: dict) -> list[tuple[list[dict], SamplingParams, object]]:
    """Run a workflow; returns each request's (messages, sampling, output)."""
    agents, brief = flow["agents"], flow["brief"]
    if flow["declare"]:
        for a in agents:
            engine.declare_agent(a, _system(a, brief)["content"])
    history, done, previous, i = [{"role": "user", "content": flow["task"]}], [], None, 0
    for turns in flow["turns"]:
        batch = []
        for agent, turn in zip(agents, turns):
            messages = [_system(agent, brief)] + list(history)
            sampling = SamplingParams(max_tokens=turn["max_tokens"], temperature=0.0)
            if flow["concurrent"]:
                batch.append((agent, turn, messages, sampling))
                continue
            out = await engine.generate(messages, agent=agent, sampling=sampling)
            done.append((messages, sampling, out))
            history += _history_entry(agent, turn, out.text, previous, i)
            previous, i = out.text, i + 1
        if batch:                      # the round's agents at once, over the same history
            outs = await asyncio.gather(*(engine.generate(m, agent=a, sampling=s) for a, _, m, s in batch))
            for (agent, turn, m, s), out in zip(batch, outs):
                done.append((m, s, out))
                history += _history_entry(agent, turn, out.text, previous, i)
                previous, i = out.text, i + 1
    return done


@pytest.fixture(scope="module")
def engines():
    made = {mode: Engine(EngineConfig(reuse=mode)) for mode in ("none", "prefix", "kvcmas")}
    yield made
    for e in made.values():
        e.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "prefix", "kvcmas"])
def test_random_workflows_answer_exactly_or_within_reuse_and_free_their_kv(engines, mode, held_by_requests):
    engine, solo = engines[mode], engines["none"]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck))
    @given(flow=workflows())
    def check(flow):
        before = engine.stats()["counters"]
        done = asyncio.run(asyncio.wait_for(_run(engine, flow), 600))
        after = engine.stats()["counters"]
        assert len(done) == len(flow["agents"]) * len(flow["turns"])
        for messages, sampling, out in done:
            assert out.finish_reason in ("stop", "length", "tool_calls")
            assert 1 <= len(out.token_ids) <= sampling.max_tokens or out.finish_reason == "stop"
            assert out.fallback is None, out.fallback
        assert after["failed"] == before["failed"] and after["reuse_fallbacks"] == before["reuse_fallbacks"]
        if mode in ("none", "prefix"):
            for messages, sampling, out in done:
                alone = solo.generate_sync(messages, agent="solo", sampling=sampling, timeout=120)
                assert out.token_ids == alone.token_ids
        assert held_by_requests(engine) == 0
        st_ = engine.stats()["counters"]
        assert st_["num_running"] == 0 and st_["num_waiting"] == 0

    check()
