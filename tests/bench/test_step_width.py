"""benchmarks/step_width: forwards of a few widths on the real model."""
from __future__ import annotations

from benchmarks.step_width import run


def test_each_width_reports_its_time_per_row_and_what_a_row_adds_to_a_one_row_step():
    result = run([1, 4], reps=1)
    one, four = result["widths"]["1"], result["widths"]["4"]
    assert one["ms"] > 0 and one["ms_per_added_row"] is None
    assert four["ms_per_row"] == round(four["ms"] / 4, 2)
    assert four["ms_per_added_row"] == round((four["ms"] - one["ms"]) / 3, 2)
