"""Where a decode step over a later agent's corrected view goes: its attention, part by part.

Replays a bench trace's turns but the last under kvcmas (declared, as `kvcmas bench` does), then decodes
the last turn and captures each layer's attention over the request's kept view at its last step. With
the engine closed (one OpenMP team in the process), it times per step, over all layers:

- ``prefix``: a gather of the same keys and plain attention, what prefix caching runs;
- ``prefix_loops``: the same plain attention by the compiled CPU loops (``kernels.cpu_view``), to tell
  what the loops buy by themselves from what they buy the corrections;
- ``kvcmas``: the view's attention as the engine runs it (the compiled loops where they built);
- ``kvcmas_torch``: the same by the torch ops alone;
- ``no_lowrank`` / ``no_rotation``: the torch ops without the corrections' low-rank terms / without
  realigning the reused keys.

Prints JSON: the view's shape (keys, position shifts, corrected rows, groups) and, per thread count,
each variant's best time per step in ms (best of ``rounds`` runs of ``reps`` steps).

    python -m benchmarks.view_step [--preset full] [--trace pipeline] [--reps 10]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from typing import Callable

import torch

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.bench.runner import BenchConfig, _Bench
from kvcmas_agents.bench.traces import get_traces
from kvcmas_agents.engine import SamplingParams
from kvcmas_agents.fidelity.caller_thread import single_threaded_caller
from kvcmas_agents.fidelity.conversation import run_exact_and_close
from kvcmas_agents.fidelity.replay import replay
from kvcmas_agents.fidelity.scenarios import declare_systems
from kvcmas_agents.kernels import cpu_view
from kvcmas_agents.model.attention import sdpa
from kvcmas_agents.reuse.views import compiled, gather, lowrank

Captured = dict[int, tuple]          # layer -> (q, view, k_cache, v_cache, scale)


async def capture(preset: str, trace_name: str, tokens: int = 8) -> Captured:
    """The last decode step's attention inputs of the trace's last turn, per layer."""
    trace = get_traces(preset, [trace_name])[0]
    seen: Captured = {}
    attend = gather.gathered_attention

    def spy(q, view, k_cache, v_cache, layer, scale):
        if q.shape[0] == 1 and view.keep:
            seen[layer] = (q.clone(), view, k_cache, v_cache, scale)
        return attend(q, view, k_cache, v_cache, layer, scale)

    with single_threaded_caller() as threads:
        bench = _Bench(BenchConfig(traces=[trace], methods=["kvcmas"]), lambda _: None, threads)
        exact, _ = await run_exact_and_close(bench.engine(METHODS["none"]), trace.scenario, trace.reply_tokens, 16)
        engine = bench.engine(METHODS["kvcmas"])
        try:
            engine.set_edges(trace.scenario.edges)
            declare_systems(engine, trace.scenario)
            await bench._warm(engine)
            await replay(engine, exact[:-1], 16, True)
            last = exact[-1]
            gather.gathered_attention = spy
            try:
                await engine.generate(last.messages, agent=last.agent,
                                      sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
            finally:
                gather.gathered_attention = attend
        finally:
            await engine.aclose()
    return seen


def _variants(seen: Captured) -> dict[str, Callable[[], None]]:
    def over(views: Captured, attend: Callable = lowrank._lowrank_attention) -> Callable[[], None]:
        def step() -> None:
            for layer, (q, view, kc, vc, scale) in views.items():
                attend(q, view, kc, vc, layer, scale)
        return step

    def prefix() -> None:
        for q, view, kc, vc, scale in seen.values():
            sdpa(q, kc.index_select(0, view.slots), vc.index_select(0, view.slots), scale)

    plain = {l: (q, replace(v, stacks=[], cos=v.cos[:0]), *rest) for l, (q, v, *rest) in seen.items()}
    loops = {"prefix_loops": over(plain, compiled._compiled_attention)} if cpu_view.load() is not None else {}
    return {"prefix": prefix, **loops, "kvcmas": over(seen, gather.gathered_attention), "kvcmas_torch": over(seen),
            "no_lowrank": over({l: (q, replace(v, stacks=[]), *rest) for l, (q, v, *rest) in seen.items()}),
            "no_rotation": over({l: (q, replace(v, cos=v.cos[:0]), *rest) for l, (q, v, *rest) in seen.items()})}


def _best_ms(fn: Callable[[], None], reps: int, rounds: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def time_parts(seen: Captured, reps: int, rounds: int, threads: tuple[int, ...]) -> dict:
    """Best ms per step of each variant, per thread count, variants interleaved round by round."""
    variants, before = _variants(seen), torch.get_num_threads()
    out: dict[str, dict[str, float]] = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            out[str(n)] = {name: round(_best_ms(fn, reps, rounds), 2) for name, fn in variants.items()}
    finally:
        torch.set_num_threads(before)
    return out


def view_shape(seen: Captured) -> dict:
    view = seen[max(seen)][1]
    return {"layers": len(seen), "keys": int(view.slots.numel()), "position_shifts": int(view.q_cos.shape[0]) - 1,
            "rotated_keys": int((view.key_class > 0).sum()),
            "corrected_rows": sum(int(st.rows.numel()) for st in view.stacks),
            "groups": [len(st.groups) for st in view.stacks]}


async def run(preset: str, trace: str, reps: int, rounds: int = 5, threads: tuple[int, ...] = (2, 1)) -> dict:
    seen = await capture(preset, trace)
    return {"preset": preset, "trace": trace, "view": view_shape(seen), "cpu_loops": cpu_view.unavailable() or "built",
            "ms_per_step": time_parts(seen, reps, rounds, threads)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--trace", default="pipeline")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.preset, args.trace, args.reps)), indent=1))


if __name__ == "__main__":
    main()
