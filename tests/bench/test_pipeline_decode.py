"""benchmarks/pipeline_decode: one round of the quick pipeline on the real model."""
from __future__ import annotations

import asyncio

from benchmarks.pipeline_decode import run


def test_each_methods_decode_rate_and_its_ratio_to_prefix_are_reported():
    result = asyncio.run(run("quick", 1, tokens=8, names=("prefix", "kvcmas")))
    rates = result["decode_tok_s_after_first"]
    assert set(rates) == {"prefix", "kvcmas"} and all(len(r) == 1 and r[0] > 0 for r in rates.values())
    assert result["vs_prefix"]["prefix"] == [1.0] and result["vs_prefix_median"]["kvcmas"] > 0
