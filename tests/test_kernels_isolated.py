"""Runs tests/kernels (the Triton kernel under TRITON_INTERPRET=1 on CPU) in a fresh Python process.

In one process with the rest of the suite, the kernel tests failed in CI: the kernel functions ended up
decorated outside interpreter mode. Alone they pass, so they run alone, here; see tests/kernels/conftest.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_tests_pass_in_a_fresh_process():
    pytest.importorskip("triton")
    env = {**os.environ, "KVCMAS_KERNEL_TESTS": "1"}
    env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
