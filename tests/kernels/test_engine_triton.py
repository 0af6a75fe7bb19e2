"""The real engine with view_path="triton" (the interpreter on CPU) against the torch gather path."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvcmas_agents import Engine, EngineConfig, SamplingParams  # noqa: E402
from kvcmas_agents.fidelity import CSV_SYSTEM as SYSTEM  # noqa: E402
from kvcmas_agents.fidelity import CSV_TASK as TASK  # noqa: E402


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM[agent]}] + history


async def test_triton_and_gather_view_paths_agree(monkeypatch):
    # The gather path's decode keeps unpacked codes (state while it runs); compared without them, the two
    # paths hold the same memory.
    from kvcmas_agents.switches import SWITCHES
    monkeypatch.setattr(SWITCHES, "keep_codes", False)
    history = [{"role": "user", "content": TASK}, {"role": "user", "content": "[planner] 1. Read the file. 2. Sum."}]
    outs, peaks = [], []
    for path in ("gather", "triton"):
        eng = Engine(EngineConfig(reuse="kvcmas", view_path=path, dtype="float32"))
        try:
            assert eng.stats()["engine"]["view_path"] == path
            await eng.generate(prompt("planner", history), agent="planner",
                               sampling=SamplingParams(max_tokens=1))
            outs.append(await eng.generate(prompt("coder", history), agent="coder",
                                           sampling=SamplingParams(max_tokens=4, return_logits=True)))
            peaks.append(eng.stats()["memory"]["total_bytes_peak"])
        finally:
            await eng.aclose()
    gather, triton = outs
    assert gather.usage.reused_tokens == triton.usage.reused_tokens > 0
    assert gather.usage.recomputed_tokens == triton.usage.recomputed_tokens > 0
    assert gather.token_ids == triton.token_ids
    for a, b in zip(gather.logits, triton.logits):
        assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()
    assert peaks[0] == peaks[1]          # the kernel holds no per-agent copy of the view


def test_view_path_resolution(monkeypatch):
    import kvcmas_agents.kernels as kernels
    from kvcmas_agents.reuse.views import resolve_view_path
    cpu = torch.device("cpu")
    assert resolve_view_path("auto", cpu) == "gather"
    assert resolve_view_path("query", cpu) == "query"
    with pytest.raises(ValueError):
        EngineConfig(view_path="fused")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_view_path("triton", cpu)
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(ImportError, match="kvcmas-agents\\[triton\\]"):
        resolve_view_path("triton", cpu)
    assert resolve_view_path("auto", torch.device("cuda")) == "gather"    # no Triton: the torch path
