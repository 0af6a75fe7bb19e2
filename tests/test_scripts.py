"""scripts/gpu_bench.sh, the device command of issue 5's full mode, run on CPU at the smallest sizes:
each part writes its report, and a part that runs past its limit is stopped without stopping the rest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_parts_report_and_a_part_past_its_limit_does_not_stop_the_rest(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "DEVICE": "cpu",
           "MODEL_8B": "random:tiny", "PRESET": "tiny", "TRACE": "csv", "LONG_PRESET": "tiny",
           "T_8B": "1", "T_SMOL": "300", "T_LONG": "300"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr          # the 8B part was stopped at 1 s
    assert "== bench_8b rc=124" in (tmp_path / "bench_8b.log").read_text()
    assert not (tmp_path / "bench_8b" / "bench.json").exists()
    assert not (tmp_path / "gpu_check.log").exists()                # the kernel check is for CUDA only
    for part, model in (("bench_smollm", None), ("bench_8b_long", "random:tiny")):
        report = json.loads((tmp_path / part / "bench.json").read_text())
        assert report["config"]["model"] == model and report["config"]["dtype"] == "bfloat16"
        methods = report["traces"]["csv"]["methods"]
        assert {"prefix", "kvcomm", "kvcmas"} <= set(methods)
        assert all(m["memory"]["kv_bytes_total_peak"] > 0 for m in methods.values())
        assert (tmp_path / part / "bench.md").exists()
    assert "gpu_bench: status=1" in proc.stdout
