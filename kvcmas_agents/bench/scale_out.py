"""``kvcmas bench scale-out``: throughput and TTFT of concurrent multi-agent workflows over 1, 2, 4 replicas.

W workflows run at once, each its own session: three agents (own system prompts) take turns over one
growing history, so each workflow's turns reuse each other's KV on the replica the session sticks to.
Requests go through ``RayBackend`` (no HTTP). For each replica count the run reports workflow turns/s,
generated tokens/s, and TTFT p50/p95 as the client sees it (stream start to first token).

CPU replicas share the machine's cores: each gets cores // replicas intra-op threads (at least 1), so
more replicas than cores oversubscribe, and the JSON says so.

    kvcmas bench scale-out [--replicas 1 2 4] [--workflows 4] [--turns 3] [--max-tokens 16]
        [--reuse kvcmas] [--threads T] [--device cpu] [--address ADDR] [--tag TAG]

Writes <out>/<tag>/scale_out.json and scale_out.md (default docs/results/scale_out/, from the checkout).
Needs the ``ray`` extra.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import EngineConfig, SamplingParams

if TYPE_CHECKING:
    from ..serve.ray_backend import RayBackend

HELP = "concurrent multi-agent workflows over 1, 2, 4 Ray replicas: throughput and TTFT (extra [ray])"

AGENTS = {"planner": "You are the planner. Break the task into short numbered steps.",
          "coder": "You are the coder. Write the Python code the plan asks for.",
          "reviewer": "You are the reviewer. Point out bugs and missing tests in the code."}
TASKS = ["merges overlapping intervals", "parses ISO 8601 durations", "computes a rolling median",
         "validates IPv4 addresses", "flattens nested dictionaries", "finds the longest palindrome",
         "schedules meetings without overlap", "deduplicates a stream of events"]
RESULTS = "docs/results/scale_out"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def workflow(backend: RayBackend, index: int, turns: int, sampling: SamplingParams) -> list[dict[str, Any]]:
    """One workflow's turns, in order; returns each turn's client TTFT, latency and usage."""
    session = f"wf-{index}"
    history = [{"role": "user", "content": f"Workflow {index}: write a Python function that "
                                           f"{TASKS[index % len(TASKS)]}, with tests."}]
    names = list(AGENTS)
    rows = []
    for turn in range(turns):
        agent = names[turn % len(names)]
        messages = [{"role": "system", "content": AGENTS[agent]}, *history]
        start, first, out = time.perf_counter(), None, None
        async for delta in backend.stream(messages, agent=f"{session}-{agent}", sampling=sampling, session=session):
            if first is None and delta.token_ids:
                first = time.perf_counter()
            if delta.output is not None:
                out = delta.output
        end = time.perf_counter()
        rows.append({"session": session, "agent": agent, "ttft_s": (first or end) - start, "latency_s": end - start,
                     "completion_tokens": out.usage.completion_tokens, "prompt_tokens": out.usage.prompt_tokens,
                     "reused_tokens": out.usage.reused_tokens, "cached_tokens": out.usage.cached_tokens,
                     "replica": backend.replica_of(session)})
        history.append({"role": "assistant", "content": f"[{agent}] {out.text}"})
    return rows


async def run_one(replicas: int, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    from ..serve.ray_backend import RayBackend, RayBackendConfig
    threads = args.threads or max(1, cores // replicas)
    config = RayBackendConfig(
        replicas=replicas, address=args.address, threads_per_replica=threads,
        cpus_per_replica=1.0 if args.device.startswith("cuda") else min(1.0, cores / replicas),
        engine=EngineConfig(device=args.device, reuse=args.reuse, kv_budget_bytes=args.kv_budget_mib * 1024**2))
    t0 = time.perf_counter()
    backend = RayBackend(config)
    startup = time.perf_counter() - t0
    try:
        warm = SamplingParams(max_tokens=2)
        await asyncio.gather(*(_drain(backend.stream([{"role": "user", "content": "Hi"}], agent="warmup",
                                                     sampling=warm))
                               for i in range(replicas)))
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        per_wf = await asyncio.gather(*(workflow(backend, i, args.turns, sampling) for i in range(args.workflows)))
        wall = time.perf_counter() - t0
        stats = await backend.stats()
    finally:
        await backend.aclose()
    rows = [r for wf in per_wf for r in wf]
    ttfts = [r["ttft_s"] for r in rows]
    tokens = sum(r["completion_tokens"] for r in rows)
    return {
        "replicas": replicas, "threads_per_replica": threads, "cpus_per_replica": config.cpus_per_replica,
        "oversubscribed": (not args.device.startswith("cuda")) and replicas * threads > cores,
        "startup_s": round(startup, 2), "wall_s": round(wall, 3),
        "turns": len(rows), "turns_per_s": round(len(rows) / wall, 3),
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p95_s": round(percentile(ttfts, 0.95), 4),
        "latency_p50_s": round(statistics.median(r["latency_s"] for r in rows), 4),
        "reused_tokens": sum(r["reused_tokens"] for r in rows),
        "sessions_per_replica": [s["sessions"] for s in stats["replicas"]],
        "completed_per_replica": [s["counters"]["completed"] for s in stats["replicas"] if s["alive"]],
        "turn_rows": rows,
    }


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Scale-out on Ray ({result['tag']})", "",
             f"`{result['command']}`", "",
             f"{result['workflows']} workflows x {result['turns']} turns, max_tokens {result['max_tokens']} "
             f"(ignore_eos), reuse `{result['reuse']}`, device `{result['device']}`, {result['cores']} cores.", "",
             "| replicas | threads each | oversubscribed | turns/s | tokens/s | TTFT p50 (s) | TTFT p95 (s) "
             "| latency p50 (s) | sessions per replica |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['replicas']} | {r['threads_per_replica']} | {'yes' if r['oversubscribed'] else 'no'} "
                     f"| {r['turns_per_s']} | {r['tokens_per_s']} | {r['ttft_p50_s']} | {r['ttft_p95_s']} "
                     f"| {r['latency_p50_s']} | {r['sessions_per_replica']} |")
    return "\n".join(lines) + "\n"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workflows", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reuse", default="kvcmas")
    parser.add_argument("--threads", type=int, default=None, help="threads per replica (default: cores // replicas)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-budget-mib", type=int, default=256)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--tag", default=None, help="results folder name (default: the git commit)")
    parser.add_argument("--out", default=RESULTS, help=f"where the <tag> folder goes (default {RESULTS})")


def run(args: argparse.Namespace) -> int:
    import ray

    cores = os.cpu_count() or 1
    tag = args.tag or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or "untagged"
    if args.address is None:
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address, log_to_driver=False)
    try:
        runs = []
        for n in args.replicas:
            one = asyncio.run(run_one(n, args, cores))
            print(json.dumps({k: v for k, v in one.items() if k != "turn_rows"}), flush=True)
            runs.append(one)
    finally:
        ray.shutdown()
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "scale-out"] else []
    result = {"tag": tag, "command": "kvcmas bench scale-out " + shlex.join(argv),
              "workflows": args.workflows, "turns": args.turns, "max_tokens": args.max_tokens,
              "reuse": args.reuse, "device": args.device, "cores": cores, "runs": runs}
    out = Path(args.out) / tag
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_out.json").write_text(json.dumps(result, indent=1))
    (out / "scale_out.md").write_text(markdown(result))
    print(markdown(result))
    return 0
