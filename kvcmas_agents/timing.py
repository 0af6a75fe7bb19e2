"""Where a request's time goes: wall seconds per named phase, summed over the request's life.

Phases are recorded by the engine and the reuse methods on the request (``Request.timings``) and
handed back in ``RequestOutput.timings``. They are host wall time: on CUDA, work still queued on the
device when a phase ends is counted in a later phase.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Timings(dict):
    """Seconds by phase name."""

    def add(self, phase: str, seconds: float) -> None:
        self[phase] = self.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)
