"""``kvcmas peers`` end to end on this engine (the peers are never installed in CI): the trace is built
to size, each engine runs in its own process, and a peer that is not installed is reported, not run."""
from __future__ import annotations

import json

from kvcmas_agents.bench.peers import cli


def test_peers_runs_our_engine_and_reports_a_missing_peer(tmp_path):
    out = tmp_path / "peers"
    rc = cli.main(["--contexts", "120", "--agents", "2", "--rounds", "1", "--reply-tokens", "3",
                   "--solo-tokens", "5", "--engines", "kvcmas-prefix", "kvcmas-prefix-dense", "llama.cpp",
                   "--llama-python", str(tmp_path / "none"), "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "peers.json").read_text())
    assert results["missing"] == ["llama.cpp"]
    run, dense = results["runs"]
    assert run["name"] == "kvcmas-prefix" and run["shared_tokens"] >= 120 and run["reuse_fallbacks"] == 0
    assert run["weights"].startswith("blocks") and dense["weights"] == "dense: asked for"
    assert run["solo_tok_s"] > 0 and dense["solo_tok_s"] > 0
    assert len(run["turns"]) == 2 and all(t["ttft_s"] > 0 and t["decode_s"] > 0 for t in run["turns"])
    assert run["wall_s"] >= sum(t["s"] for t in run["turns"]) and run["decode_tok_s"] > 0
    assert run["peak_rss_bytes"] > 100 * 2**20                # the model's weights at least
    text = (out / "peers.md").read_text()
    assert "Not installed (scripts/setup_peers.sh): llama.cpp." in text and "kvcmas reuse=prefix" in text
    assert "kvcmas reuse=prefix, dense weights" in text and "solo decode tok/s" in text


def test_the_inline_row_corrects_nothing_ahead_of_time_and_the_bf16_row_recomputes_in_bf16(tmp_path):
    """``kvcmas-kvcmas-inline`` is kvcmas with prefetch off, and its run says so: no correction was
    made between turns, while the default row makes them once the agents' prefixes are known.
    ``kvcmas-kvcmas-bf16`` says its recompute ran in bf16 products, the default row in the model's fp32."""
    out = tmp_path / "peers"
    rc = cli.main(["--contexts", "120", "--agents", "2", "--rounds", "2", "--reply-tokens", "3",
                   "--solo-tokens", "3", "--engines", "kvcmas-kvcmas", "kvcmas-kvcmas-inline", "kvcmas-kvcmas-bf16", "--out", str(out)])
    assert rc == 0
    default, inline, bf16 = json.loads((out / "peers.json").read_text())["runs"]
    assert bf16["recompute_products"] == "bfloat16" and bf16["engine"] == "kvcmas reuse=kvcmas, bf16 recompute"
    assert default["recompute_products"] == "float32"
    assert default["prefetch"] == "decode" and default["prefetched"] > 0
    assert inline["prefetch"] == "off" and inline["prefetched"] == 0
    assert inline["engine"] == "kvcmas reuse=kvcmas, prefetch=off" and inline["reuse_fallbacks"] == 0


def test_a_trace_past_the_window_is_refused_before_any_run(tmp_path):
    import pytest
    with pytest.raises(SystemExit, match="past the model's 8192"):
        cli.main(["--contexts", "8000", "--engines", "kvcmas-prefix", "--out", str(tmp_path)])
