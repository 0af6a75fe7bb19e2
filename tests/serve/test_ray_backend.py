"""RayBackend on a local Ray cluster with 2 CPU replicas of the default model (real engines, no mocks).

One cluster and one backend for the module; the tests that kill its replicas (one, then waiting for
its replacement; then both) run after the others that use it (the last test brings up its own pair).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kvcmas_agents import EngineConfig, SamplingParams  # noqa: E402
from kvcmas_agents.errors import InvalidRequestError, ReplicaUnavailableError  # noqa: E402
from kvcmas_agents.serve.ray_backend import RayBackend, RayBackendConfig  # noqa: E402
from kvcmas_agents.serve.replacement import ReplacementConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASK = {"role": "user", "content": "Write a Python function that merges overlapping intervals, with tests."}
AGENTS = ("planner", "coder", "reviewer")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def backend():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = EngineConfig(reuse="kvcmas", kv_budget_bytes=256 * 1024**2)
    b = RayBackend(RayBackendConfig(replicas=2, engine=engine, cpus_per_replica=1.0))
    yield b
    asyncio.run(b.aclose())
    ray.shutdown()


async def workflow(b: RayBackend, session: str, turns: int = 3, max_tokens: int = 6) -> list:
    """Agents taking turns over one growing history, as one session; returns their outputs."""
    history, outs = [TASK], []
    for turn in range(turns):
        agent = f"{session}-{AGENTS[turn % len(AGENTS)]}"
        messages = [{"role": "system", "content": f"You are the {AGENTS[turn % len(AGENTS)]}."}, *history]
        async for delta in b.stream(messages, agent=agent, sampling=SamplingParams(max_tokens=max_tokens),
                                    session=session):
            if delta.output is not None:
                outs.append(delta.output)
        history.append({"role": "assistant", "content": outs[-1].text})
    return outs


async def replica_stats(b: RayBackend, replica: int) -> dict:
    return (await b.stats())["replicas"][replica]


def request_blocks(stats: dict) -> int:
    """KV blocks held by requests (in use, less those of home views, which outlive requests)."""
    m = stats["memory"]
    return m["blocks_in_use"] - m["home_view_bytes"] // m["block_bytes"]


def test_the_replicas_import_this_checkout(backend):
    assert len(backend.replica_info) == 2
    assert len({info["pid"] for info in backend.replica_info}) == 2
    assert all(Path(info["package"]).is_relative_to(ROOT) for info in backend.replica_info)
    assert backend.model_name and backend.max_context > 0


async def test_workflows_stick_to_one_replica_share_kv_there_and_spread(backend):
    outs_a, outs_b = await asyncio.gather(workflow(backend, "wf-a"), workflow(backend, "wf-b"))
    ra, rb = backend.replica_of("wf-a"), backend.replica_of("wf-b")
    assert {ra, rb} == {0, 1}                          # two sessions, two replicas
    assert all(o.finish_reason in ("stop", "length") for o in outs_a + outs_b)
    assert all(o.usage.reused_tokens > 0 for o in outs_a[1:] + outs_b[1:])    # cross-agent reuse
    stats = await backend.stats()
    for session, replica in (("wf-a", ra), ("wf-b", rb)):
        mine = stats["replicas"][replica]["agents"]
        other = stats["replicas"][1 - replica]["agents"]
        for agent in AGENTS:                           # every turn of the session ran on its replica
            assert mine[f"{session}-{agent}"]["requests"] == 1
            assert f"{session}-{agent}" not in other
        assert mine[f"{session}-coder"]["reused_tokens"] > 0 and mine[f"{session}-reviewer"]["reused_tokens"] > 0
        assert stats["replicas"][replica]["sessions"] >= 1
    assert stats["alive"] == 2
    assert stats["counters"]["completed"] == sum(r["counters"]["completed"] for r in stats["replicas"])


async def test_engine_errors_come_back_as_their_own_class(backend):
    with pytest.raises(InvalidRequestError, match="agent"):
        async for _ in backend.stream([TASK], agent="", sampling=SamplingParams(max_tokens=2), session="wf-a"):
            pass
    assert await backend.count_tokens([TASK]) > 10
    await backend.set_edges([("wf-a-planner", "wf-a-coder")], session="wf-a")
    assert (await replica_stats(backend, backend.replica_of("wf-a")))["edges"] == [("wf-a-planner", "wf-a-coder")]


async def test_closing_a_stream_aborts_the_request_on_its_replica_and_frees_its_kv(backend):
    await workflow(backend, "wf-c", turns=1, max_tokens=2)
    replica = backend.replica_of("wf-c")
    before = await replica_stats(backend, replica)
    stream = backend.stream([TASK], agent="wf-c-long", session="wf-c",
                            sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    deltas = [await stream.__anext__() for _ in range(2)]
    assert all(d.output is None for d in deltas)
    during = await replica_stats(backend, replica)
    assert during["counters"]["num_running"] == 1
    assert request_blocks(during) > request_blocks(before) == 0
    await stream.aclose()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = await replica_stats(backend, replica)
        if after["counters"]["aborted"] > before["counters"]["aborted"]:
            break
        await asyncio.sleep(0.2)
    assert after["counters"]["aborted"] == before["counters"]["aborted"] + 1
    assert after["counters"]["completed"] == before["counters"]["completed"]     # stopped, not finished
    assert after["counters"]["num_running"] == 0
    assert request_blocks(after) == 0
    assert backend.router.replicas[replica].in_flight == 0


def test_replicas_that_cannot_start_fail_the_backend_clearly(backend):
    with pytest.raises(ReplicaUnavailableError, match="failed to start"):
        RayBackend(RayBackendConfig(replicas=1, engine=EngineConfig(model=str(ROOT / "no-such-model")),
                                    cpus_per_replica=0, ready_timeout_s=120))   # 0 CPUs: schedulable beside the 2 replicas
    assert ray.is_initialized()                # the cluster it did not start is left running


async def test_a_killed_replica_fails_its_request_cleanly_its_session_moves_and_it_is_replaced(backend):
    await workflow(backend, "wf-k", turns=1, max_tokens=2)
    dead = backend.replica_of("wf-k")
    old_pid = backend.replica_info[dead]["pid"]
    stream = backend.stream([TASK], agent="wf-k-long", session="wf-k",
                            sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    assert (await stream.__anext__()).output is None
    ray.kill(backend.actor(dead))
    with pytest.raises(ReplicaUnavailableError, match=f"replica {dead} failed while serving"):
        async for _ in stream:
            pass
    assert backend.router.live == [1 - dead]
    # The session is answered at once by the live replica while the fresh one loads its model.
    outs = await workflow(backend, "wf-k", turns=2, max_tokens=4)
    assert backend.replica_of("wf-k") == 1 - dead
    assert len(outs) == 2 and all(o.usage.completion_tokens > 0 for o in outs)
    during = await backend.stats()
    # (usually still replacing then; on a fast machine the fresh one may already be up)
    assert during["replacing"] + during["replaced"] == 1 and during["alive"] + during["replacing"] == 2
    assert during["replicas"][dead]["state"] in ("replacing", "alive")
    assert "wf-k-planner" in during["replicas"][1 - dead]["agents"]
    deadline = time.monotonic() + 120
    while (stats := await backend.stats())["replaced"] < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert (stats["alive"], stats["replacing"], stats["replaced"]) == (2, 0, 1)   # N live again, counted
    assert stats["replicas"][dead]["state"] == "alive" and stats["replicas"][dead]["generation"] == 1
    assert stats["replacement"]["in_window"] == 1 and stats["replacement"]["failed_starts"] == 0
    assert backend.replica_info[dead]["pid"] != old_pid and backend.router.live == [0, 1]
    assert stats["replicas"][dead]["counters"]["requests"] == 0             # a fresh engine: cold
    assert all(backend.replica_of(s) != dead for s in ("wf-a", "wf-b", "wf-c", "wf-k") if backend.replica_of(s) is not None)
    await workflow(backend, "wf-new", turns=1, max_tokens=2)                # new sessions reach it by load
    assert backend.replica_of("wf-new") == dead
    assert "wf-new-planner" in (await replica_stats(backend, dead))["agents"]


async def test_a_request_is_retried_once_and_fails_clearly_when_the_retry_dies_too(backend):
    backend.supervisor.config.enabled = False      # keep them dead: no model loads for the rest of the module
    await workflow(backend, "wf-t", turns=1, max_tokens=2)
    for replica in (0, 1):
        ray.kill(backend.actor(replica))
    with pytest.raises(ReplicaUnavailableError, match="failed on the retry of this request"):
        await workflow(backend, "wf-t", turns=1, max_tokens=2)
    assert backend.router.live == []
    stats = await backend.stats()
    assert (stats["alive"], stats["replacing"]) == (0, 0)
    assert [r["state"] for r in stats["replicas"]] == ["dead", "dead"]


async def test_a_replica_found_dead_before_the_first_delta_is_skipped_and_the_request_answered(backend):
    """A replica that died while idle: the next request to it is re-routed, not failed (nothing was
    streamed yet). A replacement that cannot start is not retried past the cap (no crash loop). With no
    replica left, requests fail at once with the clear error."""
    engine = EngineConfig(reuse="kvcmas", kv_budget_bytes=128 * 1024**2)
    policy = ReplacementConfig(max_replacements=1, backoff_s=0.1, health_check_s=None)
    fresh = RayBackend(RayBackendConfig(replicas=2, engine=engine, cpus_per_replica=0,    # beside the module's
                                        replacement=policy))
    try:
        await workflow(fresh, "wf-r", turns=1, max_tokens=2)
        dead = fresh.replica_of("wf-r")
        fresh.config.engine = EngineConfig(model=str(ROOT / "no-such-model"))    # replacements cannot start
        ray.kill(fresh.actor(dead))
        outs = await workflow(fresh, "wf-r", turns=2, max_tokens=3)
        assert len(outs) == 2 and fresh.replica_of("wf-r") == 1 - dead
        assert fresh.router.live == [1 - dead] and "ActorDiedError" in fresh.errors[dead]
        deadline = time.monotonic() + 60
        while (stats := await fresh.stats())["replacement"]["refused"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (stats["alive"], stats["replacing"], stats["replaced"]) == (1, 0, 0)
        assert stats["replacement"]["failed_starts"] == 1 and stats["replacement"]["in_window"] == 1
        assert stats["replicas"][dead]["state"] == "dead"        # one start failed, the cap refused a second
        ray.kill(fresh.actor(1 - dead))
        deadline = time.monotonic() + 20            # the health check finds it with no request sent
        while not (found := await fresh.check_health()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert found == [1 - dead] and fresh.router.live == []
        with pytest.raises(ReplicaUnavailableError, match="no engine replica is alive"):
            await workflow(fresh, "wf-r", turns=1, max_tokens=2)
        stats = await fresh.stats()
        assert stats["alive"] == 0 and stats["replacement"]["refused"] == 2
    finally:
        await fresh.aclose()
