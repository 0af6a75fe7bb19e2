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
