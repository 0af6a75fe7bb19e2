"""The kernel microbenchmark runs end to end on tiny shapes (interpreter on CPU) and agrees with SDPA."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from benchmarks.kernel_bench import main  # noqa: E402


def test_quick_bench_writes_reports(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    rows = report["rows"]
    assert {r["method"] for r in rows} == {"kernel", "pack_view", "sdpa_view", "sdpa_exact"}
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    tol = 1e-4 if report["meta"]["dtype"] == "float32" else 3e-2
    assert all(r["max_abs_err"] <= tol for r in rows if r["method"] == "kernel")
    assert "| context |" in (tmp_path / "kernel_bench.md").read_text()
