"""The measuring thread (harness, bench) scores one-threaded and hands engines the count it had."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.fidelity.caller_thread import single_threaded_caller


def test_the_caller_runs_single_threaded_inside_and_is_restored_after():
    before = torch.get_num_threads()
    with single_threaded_caller() as threads:
        assert threads == before and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        with single_threaded_caller(engine_threads=3) as threads:
            assert threads == 3
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
