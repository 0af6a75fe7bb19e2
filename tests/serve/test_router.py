"""The affinity router alone: sessions stick, new ones spread by load, dead replicas hand theirs over."""
from __future__ import annotations

import pytest

from kvcmas_agents.errors import EngineError, ReplicaUnavailableError
from kvcmas_agents.serve.router import AffinityRouter, RouterConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_session_sticks_to_its_replica_whatever_the_load():
    router = AffinityRouter(2)
    first = router.acquire("wf-a")
    for _ in range(5):           # its own load would send a new session elsewhere, not it
        assert router.acquire("wf-a") == first
    assert router.replicas[first].in_flight == 6 and router.replicas[first].sessions == 1


def test_new_sessions_go_to_the_least_loaded_live_replica():
    router = AffinityRouter(3)
    assert [router.route(s) for s in ("a", "b", "c")] == [0, 1, 2]      # equal load: by sessions
    router.acquire("a")
    router.acquire("a")
    router.acquire("b")
    # in flight first: replica 2 has none, even holding more sessions
    assert router.route("d") == 2
    assert router.route("e") == 2
    assert [r.sessions for r in router.replicas] == [1, 1, 3]
    router.acquire("e")
    router.acquire("a")
    router.release(0)
    router.release(0)                      # in flight now [1, 1, 1]: fewest sessions wins
    assert router.route("f") == 0 and router.replicas[2].sessions == 3


def test_release_lowers_the_load_and_never_goes_negative():
    router = AffinityRouter(2)
    r = router.acquire("a")
    router.release(r)
    router.release(r)
    assert router.replicas[r].in_flight == 0


def test_requests_without_a_session_spread_over_equal_replicas():
    router = AffinityRouter(3)
    picked = {router.route(None) for _ in range(6)}
    assert picked == {0, 1, 2}
    assert len(router) == 0          # sessionless requests are not remembered
    busy = router.acquire(None)
    assert all(router.route(None) != busy for _ in range(4))    # the busy one is avoided


def test_a_dead_replica_hands_its_sessions_to_live_ones():
    router = AffinityRouter(2)
    a, b = router.route("a"), router.route("b")
    assert a != b
    router.mark_dead(a)
    assert router.live == [b]
    assert router.route("a") == b and router.route("b") == b
    assert router.replicas[a].sessions == 0 and router.replicas[b].sessions == 2
    assert all(router.route(s) == b for s in ("c", None))
    router.mark_alive(a)
    assert router.route("a") == b          # moved sessions stay where their KV now is
    assert router.route("d") == a


def test_no_live_replica_is_a_clear_engine_error():
    router = AffinityRouter(1)
    router.mark_dead(0)
    with pytest.raises(ReplicaUnavailableError, match="no engine replica"):
        router.route("a")
    assert issubclass(ReplicaUnavailableError, EngineError)


def test_the_session_map_is_bounded_least_recently_used_first():
    router = AffinityRouter(2, RouterConfig(max_sessions=3, idle_ttl_s=None))
    for s in ("a", "b", "c"):
        router.route(s)
    router.route("a")                       # a is now the most recent
    router.route("d")                       # evicts b
    assert len(router) == 3
    assert router.replica_of("b") is None and router.replica_of("a") is not None
    assert sum(r.sessions for r in router.replicas) == 3


def test_idle_sessions_expire():
    clock = Clock()
    router = AffinityRouter(2, RouterConfig(idle_ttl_s=10.0), clock=clock)
    router.route("old")
    clock.t = 5.0
    router.route("recent")
    clock.t = 12.0
    router.route(None)
    assert router.replica_of("old") is None and router.replica_of("recent") is not None
    assert sum(r.sessions for r in router.replicas) == 1


def test_many_sessions_balance_over_replicas():
    router = AffinityRouter(4)
    for i in range(100):
        router.route(f"wf-{i}")
    assert [r.sessions for r in router.replicas] == [25, 25, 25, 25]


def test_replacements_back_off_per_replica_and_stop_at_the_cap_within_the_window():
    pytest.importorskip("ray")
    from kvcmas_agents.serve.replacement import ReplacementBudget, ReplacementConfig

    clock = Clock()
    budget = ReplacementBudget(ReplacementConfig(max_replacements=3, window_s=100.0, backoff_s=2.0,
                                                 backoff_max_s=5.0), clock=clock)
    assert budget.delay(0) == 0.0 and budget.take(0)           # a slot's first: at once
    assert budget.delay(0) == 2.0 and budget.take(0)           # its next ones wait, doubling
    assert budget.delay(0) == 4.0 and budget.delay(1) == 0.0   # back-off is per slot
    assert budget.take(1)
    assert not budget.take(0) and not budget.take(1)           # the cap holds for all slots together
    assert budget.in_window() == 3 and budget.in_window(0) == 2
    clock.t = 99.0
    assert not budget.take(0)
    clock.t = 100.0                                            # the first starts leave the window
    assert budget.in_window() == 0 and budget.delay(0) == 0.0 and budget.take(0)
    for _ in range(3):
        clock.t += 1.0
        budget.take(1)
    assert budget.in_window(1) == 2 and budget.delay(1) == 4.0
    budget.config.max_replacements = 10
    budget.take(1)
    budget.take(1)
    assert budget.delay(1) == 5.0                              # capped at backoff_max_s
