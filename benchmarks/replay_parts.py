"""Where a whole replay's time goes, part by part: prefix against kvcmas on one trace.

Runs ``kvcmas bench``'s own declared replay of a trace (whole replies decoded) for each method, one
engine at a time, with timers around the engine's parts: the decode steps (their attention and the
rest), the steps that compute prompt tokens, and KVCMAS's corrections at turn time and ahead of time,
split into the selection pass, the recompute's attention and context gather, compression, and the
rest (the recomputed rows' projections and MLPs). It reports seconds by part and, against the first
method, the seconds each part adds, so a gap in the whole replay is read off its parts.

    python -m benchmarks.replay_parts [--preset full] [--trace pipeline] [--methods prefix kvcmas] [--rounds 1]

The timers cost a few microseconds a call (about 45,000 calls in a full pipeline replay).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.bench.report import replay_work
from kvcmas_agents.bench.runner import BenchConfig, _Bench
from kvcmas_agents.bench.traces import get_traces
from kvcmas_agents.engine import paged_attention, runner
from kvcmas_agents.fidelity.caller_thread import single_threaded_caller
from kvcmas_agents.fidelity.conversation import run_exact_and_close
from kvcmas_agents.reuse import cross_agent, recompute
from kvcmas_agents.reuse.kvcmas import correction, prefetch, select


class Timers:
    """Seconds and calls by part; ``part`` says which part a timed call belongs to."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.ahead = False            # inside an ahead-of-time correction

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        self.calls[part] = self.calls.get(part, 0) + 1

    def wrap(self, fn: Callable, part: Callable[..., str | None]) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = part(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if name is not None:
                    self.add(name, time.perf_counter() - t0)
        return timed


@contextmanager
def timed_engine(timers: Timers) -> Iterator[None]:
    """Install the timers on the engine's classes and modules for the block's duration."""
    def decode_step(self: Any, items: list) -> str:
        return "decode_steps" if all(i.num_tokens == 1 for i in items) else "prompt_steps"

    def attention(self: Any, layer: int, q: Any, k: Any, v: Any) -> str:
        return "decode_attention" if q.shape[0] == len(self.slices) else "prompt_attention"

    def correct(self: Any, view: Any) -> str:
        return "corrections_ahead" if timers.ahead else "corrections_at_turn"

    def always(name: str) -> Callable[..., str]:
        return lambda *a, **k: name

    run_ahead = prefetch.Prefetcher._run

    def ahead(self: Any, req: Any) -> Any:
        timers.ahead = True
        t0 = time.perf_counter()
        try:
            return run_ahead(self, req)
        finally:
            timers.ahead = False
            timers.add("ahead_of_time", time.perf_counter() - t0)

    patches = [(runner.ModelRunner, "run", timers.wrap(runner.ModelRunner.run, decode_step)),
               (paged_attention.PagedAttention, "__call__",
                timers.wrap(paged_attention.PagedAttention.__call__, attention)),
               (prefetch.Prefetcher, "_run", ahead),
               (correction.Corrector, "correct", timers.wrap(correction.Corrector.correct, correct)),
               (correction.Corrector, "_compress", timers.wrap(correction.Corrector._compress, always("compress"))),
               (select, "attention_mass", timers.wrap(select.attention_mass, always("selection_pass"))),
               (recompute, "rows_attention", timers.wrap(recompute.rows_attention, always("recompute_attention"))),
               (cross_agent, "gathered_kv", timers.wrap(cross_agent.gathered_kv, always("context_gather")))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def parts(result: dict, timers: Timers) -> dict[str, Any]:
    """The replay's seconds by part, and the decode steps' per-step figures."""
    s, n = timers.seconds, timers.calls
    get = lambda k: round(s.get(k, 0.0), 2)                                      # noqa: E731
    corrections = s.get("corrections_at_turn", 0.0) + s.get("corrections_ahead", 0.0)
    inside = sum(s.get(k, 0.0) for k in ("selection_pass", "recompute_attention", "context_gather", "compress"))
    steps = n.get("decode_steps", 0)
    per_step = lambda k: round(1e3 * s.get(k, 0.0) / steps, 2) if steps else None   # noqa: E731
    work = replay_work(result)
    return {
        "replay_s": round(result["wall_s"], 1),
        "tokens": {k: work[k] for k in ("prefilled", "recomputed_at_turn", "recomputed_ahead", "decoded_tokens")},
        "decode_steps": steps,
        "decode_steps_s": get("decode_steps"), "decode_attention_s": get("decode_attention"),
        "decode_rest_s": round(s.get("decode_steps", 0.0) - s.get("decode_attention", 0.0), 2),
        "decode_step_ms": per_step("decode_steps"), "decode_attention_ms": per_step("decode_attention"),
        "prompt_steps_s": get("prompt_steps"), "prompt_attention_s": get("prompt_attention"),
        "corrections_at_turn_s": get("corrections_at_turn"), "corrections_ahead_s": get("corrections_ahead"),
        "ahead_of_time_s": get("ahead_of_time"),
        "in_corrections": {"selection_pass_s": get("selection_pass"),
                           "recompute_attention_s": get("recompute_attention"),
                           "context_gather_s": get("context_gather"), "compress_s": get("compress"),
                           "rest_s": round(corrections - inside, 2)},
        "other_s": round(result["wall_s"] - s.get("decode_steps", 0.0) - s.get("prompt_steps", 0.0)
                         - corrections, 2),
    }


def _flat(row: dict) -> dict[str, float]:
    out = {k: v for k, v in row.items() if k.endswith("_s")}
    out.update({f"in_corrections.{k}": v for k, v in row["in_corrections"].items()})
    return out


async def run(preset: str, trace_name: str, names: tuple[str, ...] = ("prefix", "kvcmas"), rounds: int = 1) -> dict:
    """Each method's replay ``rounds`` times, methods interleaved within a round (a shared machine's
    drift then lands on every method alike); per-round parts, and per part the median over rounds of
    the seconds it adds against the first method."""
    trace = get_traces(preset, [trace_name])[0]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    with single_threaded_caller() as threads:
        bench = _Bench(BenchConfig(traces=[trace], methods=list(names)), lambda _: None, threads)
        exact, _ = await run_exact_and_close(bench.engine(METHODS["none"]), trace.scenario, trace.reply_tokens,
                                             bench.cfg.eval_tokens)
        warm = bench._warm

        async def warm_then_clear(engine: Any) -> None:     # the warm-up is not part of the replay
            await warm(engine)
            timers.seconds.clear()
            timers.calls.clear()
        bench._warm = warm_then_clear
        for _ in range(rounds):
            for name in names:
                timers = Timers()
                with timed_engine(timers):
                    result = await bench.replay(trace, exact, METHODS[name])
                rows[name].append(parts(result, timers))
    first = names[0]
    ratios = {n: [round(r["replay_s"] / b["replay_s"], 3) for r, b in zip(rows[n], rows[first])] for n in names}
    added = {}
    for n in names[1:]:
        per_round = [_flat(r) for r in rows[n]]
        base = [_flat(b) for b in rows[first]]
        added[n] = {k: round(statistics.median(r[k] - b[k] for r, b in zip(per_round, base)), 2) for k in base[0]}
    return {"preset": preset, "trace": trace_name, "rounds": rounds, "parts": rows,
            f"replay_vs_{first}": ratios, f"replay_vs_{first}_median": {n: statistics.median(r) for n, r in ratios.items()},
            f"seconds_added_vs_{first}_median": added}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--trace", default="pipeline")
    p.add_argument("--methods", nargs="+", default=["prefix", "kvcmas"])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.preset, args.trace, tuple(args.methods), args.rounds)), indent=1))


if __name__ == "__main__":
    main()
