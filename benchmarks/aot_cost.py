"""What ahead-of-time corrections cost a whole workflow: kvcmas with them, against the same engine
correcting everything at turn time, at its default recompute ratio and at the ahead-of-time one.

Replays a bench trace (declared, as ``kvcmas bench`` does) under prefix and three kvcmas settings, one
engine at a time, and prints JSON per setting: the replay's time, where it went (first tokens,
ahead-of-time work, decode and the rest), the prompt tokens it computed, TTFT, first-token KL,
greedy agreement and peak memory. On a CPU ahead-of-time work cannot overlap decode, so it pays only
if it computes less than turn time would, or buys TTFT and fidelity worth its time.

    python -m benchmarks.aot_cost [--preset full] [--trace pipeline]
"""
from __future__ import annotations

import argparse
import asyncio
import json

from kvcmas_agents import KVCMASConfig
from kvcmas_agents.bench.methods import Method
from kvcmas_agents.bench.report import replay_work
from kvcmas_agents.bench.runner import BenchConfig, run_bench
from kvcmas_agents.bench.traces import get_traces


def settings() -> list[Method]:
    """kvcmas at its defaults, without ahead-of-time corrections, and without them but recomputing at
    turn time as many rows as they would (``recompute_ratio`` = the default ``prefetch_ratio``)."""
    ahead = KVCMASConfig().prefetch_ratio
    return [Method("kvcmas", "kvcmas", prefetch=False),
            Method("kvcmas", "kvcmas", prefetch=False, recompute_ratio=ahead)]


def _row(m: dict) -> dict:
    f = m["fidelity"]
    return {"replay_s": round(m["wall_s"], 1), **{k: (round(v, 2) if isinstance(v, float) else v)
                                                  for k, v in replay_work(m).items() if k != "wall_s"},
            "ttft_ms": round(m["ttft_mean"] * 1e3), "first_token_kl": f.get("first_token_kl_mean"),
            "agreement": f.get("agreement_mean"),
            "peak_mib": round(m["memory"]["kv_bytes_total_peak"] / 2**20, 1)}


async def run(preset: str, trace_name: str) -> dict:
    trace = get_traces(preset, [trace_name])[0]
    cfg = BenchConfig(traces=[trace], methods=["prefix", "kvcmas"], sweep=settings(), sweep_trace=trace_name,
                      undeclared=False, throughput_tokens=0)
    entry = (await run_bench(cfg, log=lambda _: None))["traces"][trace_name]
    rows = {m["label"]: _row(m) for m in [*entry["methods"].values(), *entry["sweep"]]}
    prefix = rows["prefix"]["replay_s"]
    for r in rows.values():
        r["replay_vs_prefix"] = round(r["replay_s"] / prefix, 3)
    return {"preset": preset, "trace": trace_name, "settings": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--trace", default="pipeline")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.preset, args.trace)), indent=1))


if __name__ == "__main__":
    main()
