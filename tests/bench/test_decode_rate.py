"""kvcmas bench decode-rate: one round on the real model."""
from __future__ import annotations

import asyncio

from kvcmas_agents.bench.decode_rate import measure
from kvcmas_agents.switches import SWITCHES


def test_each_way_of_decoding_is_reported_with_what_it_holds():
    result = asyncio.run(measure(1, 24))
    v = result["variants"]
    assert v["prefix"]["vs_prefix_median"] == 1.0 and v["prefix"]["reused_tokens"] == 0
    assert all(v[n]["reused_tokens"] > 1400 and v[n]["tok_s_median"] > 0 for n in ("kvcmas", "kvcmas-unkept", "kvcmas-copy"))
    # reading the view keeps unpacked codes; unpacking every step keeps none; the copy holds a history's blocks
    assert 0 < v["kvcmas"]["held_bytes_while_decoding"] < v["kvcmas-copy"]["held_bytes_while_decoding"]
    assert v["kvcmas-unkept"]["held_bytes_while_decoding"] == 0
    assert v["prefix-ops"]["reused_tokens"] == 0 and v["kvcmas-ops"]["reused_tokens"] > 1400
    assert SWITCHES.keep_codes and SWITCHES.compiled_views and SWITCHES.rope_write
