"""The bench pipeline's sequential decode rate, rounds interleaved: prefix against kvcmas.

``kvcmas bench`` measures each method's decode once, minutes apart, so on a shared machine its ratio
moves with the machine. This runs the bench's own measurement (``_Bench.throughput``: the last turn of
each of the last 4 agents, decoded one after another after a 1-token priming turn, edges set) for
each method in turn, ``rounds`` times, one engine alive at a time, and reports the rate after the
first token and its ratio to prefix's per round. ``kvcmas-idle`` runs its ahead-of-time corrections
only while no request runs, which tells what those cost the decode.

    python -m benchmarks.pipeline_decode [--preset full] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.bench.runner import BenchConfig, _Bench
from kvcmas_agents.bench.traces import get_traces
from kvcmas_agents.fidelity.caller_thread import single_threaded_caller
from kvcmas_agents.fidelity.conversation import run_exact_and_close

NAMES = ("prefix", "kvcmas", "kvcmas-idle")


async def run(preset: str, rounds: int, tokens: int = 32, names: tuple[str, ...] = NAMES) -> dict:
    trace = get_traces(preset, ["pipeline"])[0]
    rates: dict[str, list[float]] = {n: [] for n in names}
    with single_threaded_caller() as threads:
        bench = _Bench(BenchConfig(traces=[trace], methods=list(names), throughput_tokens=tokens), lambda _: None,
                       threads)
        exact, _ = await run_exact_and_close(bench.engine(METHODS["none"]), trace.scenario, trace.reply_tokens, 16)
        for _ in range(rounds):
            for name in names:
                result = await bench.throughput(trace, exact, METHODS[name])
                rates[name].append(result["sequential_decode_only_tok_s"])
    return {"preset": preset, "rounds": rounds, "tokens_per_agent": tokens, "decode_tok_s_after_first": rates,
            "vs_prefix": {n: [round(r / p, 3) for r, p in zip(rs, rates["prefix"])] for n, rs in rates.items()},
            "vs_prefix_median": {n: statistics.median(r / p for r, p in zip(rs, rates["prefix"]))
                                 for n, rs in rates.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.preset, args.rounds)), indent=1))


if __name__ == "__main__":
    main()
