"""``kvcmas bench soak``: minutes of concurrent agent requests over a growing shared history under a small KV budget, with
random cancellations. Reports throughput, p95 TTFT and memory over time (JSON + a plot). Not run in CI.

    kvcmas bench soak [--minutes 3] [--budget-blocks 64] [--reuse kvcmas] [--cancel 0.2]

Checks on the way: every request ends (an answer, a cancellation, or one of the engine's own errors),
the worker stays alive, and at the end no request holds KV and memory is within the budget at rest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
from pathlib import Path

from ..engine import Engine, EngineConfig, EngineError, InvalidRequestError, SamplingParams

HELP = "minutes of concurrent agents under a small KV budget with random cancellations (JSON + plot)"

TOPICS = "parsing storage testing logging packaging docs errors caching".split()


def history_message(i: int) -> dict:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"Step {i}: we discuss {TOPICS[i % len(TOPICS)]} for the todo app, briefly."}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def client(engine: Engine, agent: str, history: list[dict], log: dict, args: argparse.Namespace,
                 rng: random.Random, stop_at: float) -> None:
    """One agent's loop: a request over the shared history so far; sometimes cancelled part way."""
    while time.monotonic() < stop_at:
        messages = [{"role": "system", "content": f"You are the team's {agent}."}, *history,
                    {"role": "user", "content": f"{agent}, your next step?"}]
        t0, first, tokens = time.monotonic(), None, 0
        cancel_after = rng.randint(0, 6) if rng.random() < args.cancel else None
        try:
            async for delta in engine.stream(messages, agent=agent, sampling=SamplingParams(max_tokens=args.tokens)):
                if first is None:
                    first = time.monotonic() - t0
                tokens += len(delta.token_ids)
                if cancel_after is not None and tokens >= cancel_after:
                    break                          # leaving the stream aborts the request
            log["cancelled" if cancel_after is not None and tokens >= cancel_after else "completed"] += 1
        except InvalidRequestError:                # e.g. the history outgrew the budget: shorten it
            log["rejected"] += 1
            del history[:2]
        except EngineError:
            log["failed"] += 1
        if first is not None:
            log["ttft"].append((time.monotonic(), first))
        log["tokens"] += tokens
        if rng.random() < 0.25 and len(history) < args.max_history:
            history.append(history_message(len(history) + log["completed"]))


async def sampler(engine: Engine, log: dict, stop_at: float, t_start: float) -> None:
    last_tokens, last_t = 0, time.monotonic()
    while time.monotonic() < stop_at:
        await asyncio.sleep(1.0)
        now, st = time.monotonic(), engine.stats()
        mem, c = st["memory"], st["counters"]
        recent = [t for at, t in log["ttft"] if at > now - 10]
        log["series"].append({
            "t": round(now - t_start, 2), "tokens_per_s": (log["tokens"] - last_tokens) / (now - last_t),
            "ttft_p95_s": percentile(recent, 0.95), "total_bytes": mem["total_bytes"], "kv_bytes": mem["kv_bytes"],
            "state_bytes": mem["state_bytes"], "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "running": c["num_running"], "waiting": c["num_waiting"]})
        last_tokens, last_t = log["tokens"], now


def plot(series: list[dict], budget: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s["t"] for s in series]
    fig, ax = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax[0].plot(t, [s["tokens_per_s"] for s in series])
    ax[0].set_ylabel("tokens/s")
    ax[1].plot(t, [s["ttft_p95_s"] for s in series])
    ax[1].set_ylabel("p95 TTFT (s, last 10 s)")
    for key in ("total_bytes", "kv_bytes", "state_bytes"):
        ax[2].plot(t, [s[key] / 2**20 for s in series], label=key)
    ax[2].axhline(budget / 2**20, color="k", ls="--", label="kv_budget_bytes")
    ax[2].set_ylabel("MiB")
    ax[2].set_xlabel("seconds")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def soak(args: argparse.Namespace) -> dict:
    probe = Engine(EngineConfig(reuse="none", kv_budget_bytes=2**20 * 64))
    block_bytes = probe.store.block_bytes
    probe.close()
    budget = args.budget_blocks * block_bytes
    engine = Engine(EngineConfig(reuse=args.reuse, kv_budget_bytes=budget))
    agents = [f"agent{i}" for i in range(args.agents)]
    engine.set_edges(list(zip(agents, agents[1:])))
    history = [history_message(0)]
    log = {"completed": 0, "cancelled": 0, "rejected": 0, "failed": 0, "tokens": 0, "ttft": [], "series": []}
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    stop_at = t_start + args.minutes * 60
    await asyncio.gather(sampler(engine, log, stop_at, t_start),
                         *[client(engine, a, history, log, args, random.Random(rng.random()), stop_at) for a in agents])
    await asyncio.sleep(1.0)                       # let the worker settle (charge, idle work)
    st = engine.stats()
    mem = st["memory"]
    assert engine._thread.is_alive(), "the worker died"
    assert st["counters"]["num_running"] == 0 and st["counters"]["num_waiting"] == 0
    await engine.aclose()
    ttfts = [t for _, t in log["ttft"]]
    wall = time.monotonic() - t_start
    return {"settings": vars(args), "kv_budget_bytes": budget, "wall_s": round(wall, 1),
            "requests": {k: log[k] for k in ("completed", "cancelled", "rejected", "failed")},
            "tokens_per_s": log["tokens"] / wall, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p95_s": percentile(ttfts, 0.95), "total_bytes_peak": mem["total_bytes_peak"],
            "total_bytes_end": mem["total_bytes"], "state_over_budget_bytes": mem["state_over_budget_bytes"],
            "budget_fallbacks": st["counters"]["budget_fallbacks"],
            "corrections_evicted": (st["reuse"].get("kvcmas") or {}).get("corrections_evicted"),
            "series": log["series"]}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--budget-blocks", type=int, default=64, help="KV budget in blocks of the default model")
    parser.add_argument("--reuse", default="kvcmas")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens per request")
    parser.add_argument("--cancel", type=float, default=0.2, help="share of requests cancelled part way")
    parser.add_argument("--max-history", type=int, default=40, help="messages the shared history grows to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/soak")


SETTINGS = ("minutes", "budget_blocks", "reuse", "agents", "tokens", "cancel", "max_history", "seed", "out")


def run(args: argparse.Namespace) -> int:
    args = argparse.Namespace(**{k: getattr(args, k) for k in SETTINGS})    # the report's settings: these only
    report = asyncio.run(soak(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report["series"], report["kv_budget_bytes"], out / "soak.png")
    summary = {k: v for k, v in report.items() if k != "series"}
    print(json.dumps(summary, indent=1))
    return 0
