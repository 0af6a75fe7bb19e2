"""Dev: one decode step's attention (every layer) over the largest decode view of the bench pipeline,
U read as features (today) against U unpacked (``Coeffs.features`` disabled), alternated in one process.

    .venv/bin/python docs/results/features/decode_ab.py [/tmp/view.pt]

The first run replays the pipeline (exact pass, then kvcmas at its defaults, as ``kvcmas bench`` does;
about 6 min) and saves the view with each layer's query, keys and values to the given file; later runs
load it."""
import asyncio
import os
import sys
import time
from dataclasses import replace

import torch

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.bench.traces import get_traces
from kvcmas_agents.engine import Engine
from kvcmas_agents.engine import view_gather as VG
from kvcmas_agents.engine.lowrank import Coeffs
from kvcmas_agents.fidelity.caller_thread import single_threaded_caller
from kvcmas_agents.fidelity.conversation import run_exact_and_close
from kvcmas_agents.fidelity.replay import replay
from kvcmas_agents.fidelity.scenarios import declare_systems


def capture(path: str) -> None:
    orig, best = VG.gathered_attention, {"n": 0, "layers": {}, "view": None, "on": False}

    def wrapped(q, view, kc, vc, layer, scale):
        if q.shape[0] == 1:
            if layer == 0:
                best["on"] = view.slots.numel() > best["n"]
                if best["on"]:
                    best.update(n=view.slots.numel(), layers={}, view=view)
            if best["on"] and view is best["view"]:
                best["layers"][layer] = (q.clone(), kc.index_select(0, view.slots), vc.index_select(0, view.slots))
        return orig(q, view, kc, vc, layer, scale)

    async def run():
        trace = get_traces("full", ["pipeline"])[0]
        with single_threaded_caller() as threads:
            exact, _ = await run_exact_and_close(Engine(METHODS["none"].config(None, "cpu", num_threads=threads)),
                                                 trace.scenario, trace.reply_tokens, 16)
            engine = Engine(METHODS["kvcmas"].config(None, "cpu", num_threads=threads))
            try:
                engine.set_edges(trace.scenario.edges)
                declare_systems(engine, trace.scenario)
                await replay(engine, exact, 16, True)
            finally:
                await engine.aclose()

    VG.gathered_attention = wrapped
    asyncio.run(run())
    VG.gathered_attention = orig
    view = best["view"]
    torch.save({"view": replace(view, slots=torch.arange(view.slots.numel())), "layers": best["layers"]}, path)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/view.pt"
    if not os.path.exists(path):
        capture(path)
    torch.set_num_threads(2)
    saved = torch.load(path, weights_only=False)
    view, layers = saved["view"], saved["layers"]
    stacks = [(len(st.groups), st.rows.numel()) for st in view.stacks]
    print(f"view: {view.slots.numel()} keys, stacks (groups, rows) {stacks}, {view.q_cos.shape[0] - 1} deltas")
    features = Coeffs.features

    def step(on: bool) -> list[torch.Tensor]:
        Coeffs.features = staticmethod(features if on else lambda us, layer: None)
        try:
            return [VG.gathered_attention(q, view, k, v, i, 0.125) for i, (q, k, v) in layers.items()]
        finally:
            Coeffs.features = staticmethod(features)

    diff = max((a - b).abs().max().item() for a, b in zip(step(True), step(False)))
    print(f"largest difference between the two: {diff:.2e}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(20):
        for on in (False, True):
            t = time.perf_counter()
            for _ in range(3):
                step(on)
            times[on].append((time.perf_counter() - t) / 3 * 1e3)
    for on, name in ((False, "unpacked"), (True, "features")):
        ts = sorted(times[on])
        print(f"{name}: min {ts[0]:.1f} ms, median {ts[len(ts) // 2]:.1f} ms per step ({len(layers)} layers)")


if __name__ == "__main__":
    main()
