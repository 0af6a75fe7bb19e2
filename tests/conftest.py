"""Shared fixtures: one real default-model engine per reuse mode for the whole session."""
from __future__ import annotations

import pytest

from kvcmas_agents import Engine, EngineConfig


@pytest.fixture(scope="session")
def engine_none():
    engine = Engine(EngineConfig(reuse="none"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def engine_prefix():
    engine = Engine(EngineConfig(reuse="prefix"))
    yield engine
    engine.close()


@pytest.fixture
def selection_queries(monkeypatch):
    """The number of queries of every KVCMAS selection pass run while the test runs, in order."""
    from kvcmas_agents.reuse.kvcmas import select

    queries: list[int] = []
    real = select.MassBackend

    def backend(ctx, pieces, write_slots, q_positions, spans, skip=0):
        queries.append(q_positions.numel())
        return real(ctx, pieces, write_slots, q_positions, spans, skip)

    monkeypatch.setattr(select, "MassBackend", backend)
    return queries


@pytest.fixture(scope="session")
def held_by_requests():
    """A function: KV bytes an engine's requests hold (active blocks beyond the home views), read once
    the worker's ahead-of-time work is done (its side requests hold blocks while they run); 0 once all
    requests have ended."""
    import time

    def held(engine: Engine, settle_s: float = 20.0) -> int:
        deadline = time.monotonic() + settle_s
        while True:
            mem = engine.stats()["memory"]
            n = mem["kv_bytes_active"] - mem["home_view_bytes"]
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(0.05)
    return held
