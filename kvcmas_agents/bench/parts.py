"""``kvcmas bench parts``: where a whole replay's time goes, part by part, as the engine records it.

Runs ``kvcmas bench``'s own declared replay of a trace (whole replies decoded) for each method, one
engine at a time, and sums over the replay's turns what each turn's output says and the engine's stats:

- first tokens: each turn's TTFT by phase (``RequestOutput.timings``): waiting in the queue, work
  ahead of time run at its admission (``ahead``), the reuse plan, corrections at turn time (their
  selection pass, recompute and compression, and the rest of ``correct``), the forwards of the steps
  before its first token, and what no phase covers (``other``);
- decode: each turn's seconds from its first token to its last (``latency_s - ttft_s``);
- between turns: the replay's wall time that no turn covers (negative where turns overlap: a fan-out
  trace's turn groups run at once);
- ahead of time: the seconds of every correction made ahead of time (the engine's prefetch stats).
  Those run at a turn's admission are its ``ahead`` phase; the others ran between decode steps (inside
  decode) or between turns.

It reports seconds by part and, against the first method, the seconds each part adds (the median over
rounds, methods interleaved within a round), so a gap in the whole replay is read off its parts.

    kvcmas bench parts [--preset full] [--trace pipeline] [--methods prefix kvcmas] [--rounds 1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from ..fidelity.caller_thread import single_threaded_caller
from ..fidelity.conversation import run_exact_and_close
from .methods import METHODS
from .report import replay_work
from .runner import PHASES, BenchConfig, _Bench
from .traces import PRESETS, get_traces

HELP = "where a whole replay's time goes: first tokens by phase, decode, ahead-of-time corrections"


def parts(m: dict[str, Any]) -> dict[str, Any]:
    """One replay's seconds by part, summed over its turns, and the tokens behind them."""
    turns = m["turns"]
    phases = {p: sum(t["timings"].get(p, 0.0) for t in turns) for p in PHASES}
    phases["correct"] -= phases["select"] + phases["recompute"] + phases["compress"]   # its own rest
    first = sum(t["ttft_s"] for t in turns)
    phases["other"] = first - sum(phases.values())
    decode = sum(t["decode_s"] for t in turns)
    work = replay_work(m)
    decoded = work["decoded_tokens"]
    return {
        "replay_s": round(m["wall_s"], 1),
        "tokens": {k: work[k] for k in ("prefilled", "recomputed_at_turn", "recomputed_ahead", "decoded_tokens")},
        "first_tokens_s": round(first, 2),
        "first_token_phases": {f"{k}_s": round(v, 2) for k, v in phases.items()},
        "decode_s": round(decode, 2),
        "decode_ms_per_token": round(1e3 * decode / decoded, 2) if decoded else None,
        "between_turns_s": round(m["wall_s"] - first - decode, 2),
        "ahead_of_time_s": round(work["ahead_s"], 2),
    }


def _flat(row: dict[str, Any]) -> dict[str, float]:
    out = {k: v for k, v in row.items() if k.endswith("_s")}
    out.update({f"first_token_phases.{k}": v for k, v in row["first_token_phases"].items()})
    return out


async def measure(preset: str, trace_name: str, names: tuple[str, ...] = ("prefix", "kvcmas"),
                  rounds: int = 1) -> dict[str, Any]:
    """Each method's replay ``rounds`` times, methods interleaved within a round (a shared machine's
    drift then lands on every method alike); per-round parts, and per part the median over rounds of
    the seconds it adds against the first method."""
    trace = get_traces(preset, [trace_name])[0]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    with single_threaded_caller() as threads:
        bench = _Bench(BenchConfig(traces=[trace], methods=list(names)), lambda _: None, threads)
        exact, _ = await run_exact_and_close(bench.engine(METHODS["none"]), trace.scenario, trace.reply_tokens,
                                             bench.cfg.eval_tokens)
        for _ in range(rounds):
            for name in names:
                rows[name].append(parts(await bench.replay(trace, exact, METHODS[name])))
    first = names[0]
    ratios = {n: [round(r["replay_s"] / b["replay_s"], 3) for r, b in zip(rows[n], rows[first])] for n in names}
    added = {}
    for n in names[1:]:
        per_round, base = [_flat(r) for r in rows[n]], [_flat(b) for b in rows[first]]
        added[n] = {k: round(statistics.median(r[k] - b[k] for r, b in zip(per_round, base)), 2) for k in base[0]}
    return {"preset": preset, "trace": trace_name, "rounds": rounds, "parts": rows,
            f"replay_vs_{first}": ratios,
            f"replay_vs_{first}_median": {n: statistics.median(r) for n, r in ratios.items()},
            f"seconds_added_vs_{first}_median": added}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--trace", default="pipeline", help="one trace of the preset")
    parser.add_argument("--methods", nargs="+", default=["prefix", "kvcmas"], choices=list(METHODS),
                        help="the first is the one the others are compared with")
    parser.add_argument("--rounds", type=int, default=1)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(measure(args.preset, args.trace, tuple(args.methods), args.rounds)), indent=1))
    return 0
