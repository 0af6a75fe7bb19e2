"""What one forward costs by how many token rows it carries: the model's projections, MLPs and logits.

A decode step carries one row per running request; a prefill chunk or a correction's recompute many.
On a CPU a one-row step reads every weight for one row, so it tells how much a row riding along a
decode step (an ahead-of-time correction's, another agent's) would cost against the same row in a
prefill chunk. Attention is left out (it depends on the context, not on the weights). Prints JSON: per
width, the median ms of a forward of that many rows, ms per row, and ms each row adds to a one-row step,
for the model's projections as the engine runs them and, beside them, through ``F.linear``
(``switches.cpu_matmul`` off), widths interleaved.

    python -m benchmarks.step_width [--widths 1 2 4 8 16 32 64 128] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcmas_agents.switches import SWITCHES
from kvcmas_agents.model.llama import LlamaModel
from kvcmas_agents.model.loader import load_model

MAX_POSITION = 4096
OFFSET = 1000           # rows sit at positions OFFSET.. (RoPE costs the same anywhere)


@torch.inference_mode()
def forward_ms(model: LlamaModel, rows: int, reps: int) -> float:
    """Median ms of every layer's projections and MLP over ``rows`` rows, then the last row's logits."""
    args = model.args
    h0 = torch.randn(rows, args.hidden_size, dtype=model.dtype, device=model.device)
    pos = torch.arange(OFFSET, OFFSET + rows, device=model.device)
    times = []
    for _ in range(reps + 1):                       # the first run warms the allocator
        t0 = time.perf_counter()
        h = h0
        for layer in range(args.num_layers):
            q, _, _ = model.qkv(layer, h, pos)
            h = model.finish_layer(layer, h, q)         # q stands in for the attention output (same shape)
        model.logits(h[-1:])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _widths(ms: dict[int, float]) -> dict[str, dict]:
    one = ms.get(1)
    return {str(w): {"ms": round(t, 2), "ms_per_row": round(t / w, 2),
                     "ms_per_added_row": round((t - one) / (w - 1), 2) if one and w > 1 else None}
            for w, t in ms.items()}


def run(widths: list[int], reps: int, model_name: str | None = None) -> dict:
    loaded = load_model(model_name, device="cpu")
    model = LlamaModel(loaded.args, loaded.weights, MAX_POSITION)
    engine, plain = {}, {}
    saved = SWITCHES.cpu_matmul
    try:
        for w in widths:
            SWITCHES.cpu_matmul = saved
            engine[w] = forward_ms(model, w, reps)
            SWITCHES.cpu_matmul = False
            plain[w] = forward_ms(model, w, reps)
    finally:
        SWITCHES.cpu_matmul = saved
    return {"model": loaded.name, "threads": torch.get_num_threads(), "reps": reps, "cpu_matmul": saved,
            "widths": _widths(engine), "widths_f_linear": _widths(plain),
            "f_linear_over_engine": {str(w): round(plain[w] / engine[w], 3) for w in widths}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    print(json.dumps(run(args.widths, args.reps), indent=1))


if __name__ == "__main__":
    main()
