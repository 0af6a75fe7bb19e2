"""Smoke test: the example scripts run end to end as subprocesses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def agent_table(stdout: str) -> dict[str, dict[str, int]]:
    """The per-agent table an example prints last: {agent: {column: value}}."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.split()[:1] == ["agent"])
    columns = lines[start].split()[1:]
    table = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if len(cells) != len(columns) + 1:
            break
        table[cells[0]] = {c: float(v) for c, v in zip(columns, cells[1:])}
    return table


def test_engine_pipeline_example():
    out = run_example("engine_pipeline.py", "--rounds", "1", "--max-tokens", "8", "--device", "cpu")
    for agent in ("planner", "coder", "reviewer", "tester"):
        assert agent in out
    assert "TTFT ms" in out


@pytest.mark.parametrize("script, args, first, later", [
    ("langgraph_pipeline.py", ["--rounds", "1"], "planner", ["coder", "reviewer", "tester"]),
    ("langgraph_fanout.py", [], "expert_security", ["summarizer"]),
    ("autogen_roundrobin.py", ["--messages", "4"], "planner", ["coder", "reviewer"]),
    ("autogen_graphflow.py", [], "writer", ["editor", "summarizer"]),
])
def test_framework_examples_show_cross_agent_reuse(script, args, first, later):
    out = run_example(script, "--max-tokens", "8", *args)
    assert "reuse=kvcmas" in out
    table = agent_table(out)
    assert table[first]["reused"] == 0
    for agent in later:
        assert 0 < table[agent]["reused"] <= table[agent]["prompt"], agent
        assert table[agent]["recomputed"] <= table[agent]["reused"], agent
