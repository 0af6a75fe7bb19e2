"""Smoke test: the example scripts run end to end as subprocesses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_pipeline_example():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "engine_pipeline.py"), "--rounds", "1", "--max-tokens", "8",
         "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for agent in ("planner", "coder", "reviewer", "tester"):
        assert agent in proc.stdout
    assert "TTFT ms" in proc.stdout
