"""Tests for the ``kvcmas`` command line and the demo pipeline it runs."""
from __future__ import annotations

import pytest

from kvcmas_agents import Engine, EngineConfig
from kvcmas_agents.cli import COMMANDS, main
from kvcmas_agents.demos.engine_pipeline import ORDER, build_messages, format_table, run_pipeline
from kvcmas_agents.demos.langgraph_pipeline import ROLES


@pytest.fixture(scope="module")
def engine():
    """One prefix-caching engine shared by the pipeline tests in this module."""
    eng = Engine(EngineConfig(device="cpu", reuse="prefix"))
    yield eng
    eng.close()


def test_commands_registered():
    assert {"demo", "engine-demo", "chat", "info", "fidelity"} <= set(COMMANDS)


def test_chat(capsys):
    assert main(["chat", "Say hello.", "--max-tokens", "8", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "TTFT" in err and "completion tokens" in err


def test_chat_stream(capsys):
    assert main(["chat", "Say hello.", "--max-tokens", "8", "--stream", "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "TTFT" in err


def test_info(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for key in ("model", "path", "device", "dtype", "context length", "KV budget", "KV block"):
        assert key in out
    assert "smollm2" in out.lower()


def test_engine_demo_cli(capsys):
    assert main(["engine-demo", "--rounds", "1", "--max-tokens", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for agent in ORDER:
        assert agent in out
    assert "TTFT ms" in out and "KV cache" in out and "prefix hits" in out


def test_demo_runs_the_langgraph_graph_with_cross_agent_reuse(capsys):
    assert main(["demo", "--rounds", "1", "--max-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for node in ROLES:
        assert f"--- {node} (" in out
    assert "reuse=kvcmas" in out and "('planner', 'coder')" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in [[n] for n in ROLES]}
    assert int(rows["planner"][4]) == 0                      # the first agent reuses nobody
    assert all(int(rows[n][4]) > 0 for n in ("coder", "reviewer", "tester"))


def test_missing_model_is_clean(capsys):
    assert main(["info", "--model", "/no/such/model/dir"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcmas: error:") and "Traceback" not in err


def test_bad_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["chat", "hi", "--device", "nonsense"])
    assert exc.value.code == 2
    assert "invalid device" in capsys.readouterr().err


async def test_pipeline_round_two_hits_cache(engine):
    records = await run_pipeline(engine, "Write a Python function add(a, b).", rounds=2, max_tokens=8)
    assert [r["agent"] for r in records] == list(ORDER) * 2
    assert [r["round"] for r in records] == [1] * 4 + [2] * 4
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] > 0 for r in records)
    block = engine.store.block_size
    for first, second in zip(records[:4], records[4:]):
        # Round 2 extends the agent's own round-1 prompt, so at least its full blocks come from cache.
        assert second["cached_tokens"] > 0
        assert second["cached_tokens"] >= first["prompt_tokens"] // block * block
        assert second["cached_tokens"] > first["cached_tokens"]
    assert "planner" in format_table(records)
    stats = engine.stats()
    assert stats["counters"]["cached_tokens"] > 0 and set(ORDER) <= set(stats["agents"])


async def test_pipeline_parallel_review(engine):
    records = await run_pipeline(engine, "Write a Python function mul(a, b).", rounds=1, max_tokens=4,
                                 parallel_review=True)
    assert [r["agent"] for r in records] == list(ORDER)
    assert [r["parallel"] for r in records] == [False, False, True, True]


def test_layout_own_replies_are_assistant():
    history = [("moderator", "planner: plan"), ("planner", "a plan"), ("moderator", "coder: code"),
               ("coder", "some code")]
    msgs = build_messages("coder", "a task", history)
    assert [m["role"] for m in msgs] == ["system", "user", "user", "user", "user", "assistant"]
    assert msgs[3]["content"].startswith("[planner]")
    assert msgs[-1]["content"] == "some code"
    # Another agent's prompt for the same history extends the earlier one message by message.
    later = build_messages("coder", "a task", history + [("moderator", "reviewer: review"), ("reviewer", "ok")])
    assert later[:len(msgs)] == msgs
