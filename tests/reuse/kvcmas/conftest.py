"""Shared by the KVCMAS tests: the CSV conversation a test's agents reuse."""
from __future__ import annotations

from typing import Awaitable, Callable

import pytest

from kvcmas_agents import Engine, SamplingParams
from kvcmas_agents.engine import ReuseOptions
from kvcmas_agents.fidelity import CSV_SYSTEM, CSV_TASK


@pytest.fixture
def csv_history() -> Callable[..., Awaitable[list[dict]]]:
    """``await csv_history(engine, turns=3)``: the task, then exact greedy replies of the first ``turns``
    agents (computed with ``reuse="none"`` on ``engine``)."""
    async def build(engine: Engine, turns: int = 3) -> list[dict]:
        history = [{"role": "user", "content": CSV_TASK}]
        for agent in list(CSV_SYSTEM)[:turns]:
            out = await engine.generate([{"role": "system", "content": CSV_SYSTEM[agent]}] + history, agent=agent,
                                        sampling=SamplingParams(max_tokens=48), reuse_options=ReuseOptions(reuse="none"))
            history.append({"role": "user", "content": f"[{agent}] {out.text}"})
        return history
    return build
