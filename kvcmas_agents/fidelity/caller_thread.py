"""Keep a measuring thread from starting a second OpenMP thread team.

The fidelity harness and the bench score logits on the thread that drives the engines. On CPU, a
parallel torch op there would start an OpenMP team next to each engine worker's, and GNU OpenMP then
throttles its spin-waits, so every parallel region of the engines pays a sleep and wake (see
``EngineConfig.num_threads``). The scoring is small, so it runs single-threaded, and the engines get
the thread count this thread had.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def single_threaded_caller(engine_threads: int | None = None) -> Iterator[int]:
    """Yields the thread count to give engines (``EngineConfig.num_threads``: ``engine_threads``, else this
    thread's current count); meanwhile this thread's own torch ops run on one thread. Restores it on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield engine_threads or before
    finally:
        torch.set_num_threads(before)
