"""benchmarks/step_width: forwards of a few widths on the real model."""
from __future__ import annotations

from benchmarks.step_width import run


def test_each_width_reports_its_time_per_row_and_what_a_row_adds_to_a_one_row_step():
    result = run([1, 4], reps=1)
    one, four = result["widths"]["1"], result["widths"]["4"]
    assert one["ms"] > 0 and one["ms_per_added_row"] is None
    assert abs(four["ms_per_row"] - four["ms"] / 4) < 0.011             # (each figure rounded to 0.01 ms)
    assert abs(four["ms_per_added_row"] - (four["ms"] - one["ms"]) / 3) < 0.011


def test_the_engine_path_and_f_linear_are_both_timed_and_the_switch_is_restored():
    from kvcmas_agents.switches import SWITCHES
    result = run([1, 2], reps=1)
    assert SWITCHES.cpu_matmul is True and result["cpu_matmul"] is True
    assert set(result["widths_f_linear"]) == set(result["widths"]) == {"1", "2"}
    assert all(r > 0 for r in result["f_linear_over_engine"].values())
