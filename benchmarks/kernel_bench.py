"""Microbenchmark of the Triton view-attention kernel (one layer, one sequence).

For each context length and for prefill (many queries) and decode (one query) it times:
  kernel        - the fused kernel over the paged store (plus, reported apart, packing the view);
  sdpa_view     - PyTorch SDPA on a materialized corrected view (gather, realign, add low-rank: the same math);
  sdpa_exact    - PyTorch SDPA on an exact contiguous cache of the same length (the floor).
The context is an own prefix, ``--segments`` reused segments with different deltas, each with a rank
``--rank`` correction on ``--row-frac`` of its rows, and an own tail that holds the queries.

    python -m benchmarks.kernel_bench --out benchmarks/results/kernel            # GPU, bf16
    TRITON_INTERPRET=1 python -m benchmarks.kernel_bench --quick --out /tmp/kb   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Row:
    context: int
    phase: str            # "prefill" or "decode"
    queries: int
    method: str
    ms: float
    max_abs_err: float | None = None     # against sdpa_view (same math, materialized)
    extra_bytes: int = 0                 # memory the method needs beyond the store, for this layer


def _case(ctx: int, tq: int, args, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    from kvcmas_agents.reuse.storage.delta import DeltaSide, LowRankDelta
    from kvcmas_agents.reuse.realign import Realigner
    from kvcmas_agents.model.rope import inv_frequencies
    from kvcmas_agents.reuse.views.reference import OwnPiece, SegmentPiece

    kvh, dim, block = args.kv_heads, args.head_dim, 16
    blocks = -(-ctx // block) + 8
    # A paged store with the sequence's blocks in scrambled order.
    k_cache = torch.randn(blocks * block, kvh, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(blocks * block, kvh, dim, generator=gen).to(device, dtype)
    order = torch.randperm(blocks, generator=gen)[: -(-ctx // block)]
    slots = (order.repeat_interleave(block) * block + torch.arange(block).repeat(order.numel()))[:ctx]
    prefix, tail = ctx // 8, max(tq, ctx // 16)
    cuts = torch.linspace(prefix, ctx - tail, args.segments + 1).long().tolist()
    pieces: list = [OwnPiece(slots[:prefix].to(device), torch.arange(prefix, device=device))]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        n, r = b - a, args.rank
        rows = torch.randperm(n, generator=gen)[: int(args.row_frac * n)].sort().values
        f = lambda *shape: (0.1 * torch.randn(*shape, generator=gen)).to(device, dtype)  # noqa: E731
        d = LowRankDelta(rows.to(device), DeltaSide(f(1, kvh, rows.numel(), r), f(1, kvh, r, dim)),
                         DeltaSide(f(1, kvh, rows.numel(), r), f(1, kvh, r, dim)))
        pieces.append(SegmentPiece(slots[a:b].to(device), torch.arange(a, b, device=device), 37 * (i + 1) - 11,
                                   [d] if r > 0 else []))
    pieces.append(OwnPiece(slots[ctx - tail:].to(device), torch.arange(ctx - tail, ctx, device=device)))
    q = torch.randn(tq, args.heads, dim, generator=gen).to(device, dtype)
    realigner = Realigner(inv_frequencies(dim, 500000.0, None, 131072)[0].float())
    return q, torch.arange(ctx - tq, ctx, device=device), pieces, slots.to(device), k_cache, v_cache, realigner


def _timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def bench(args) -> list[Row]:
    from kvcmas_agents.model.attention import sdpa
    from kvcmas_agents.reuse.views.gather import build_gathered, gathered_attention
    from kvcmas_agents.reuse.views.pack import pack_view
    from kvcmas_agents.kernels.view_attention import view_attention_fwd

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    timed = _timer(device, args.warmup, args.iters)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    for ctx in args.contexts:
        for phase, tq in (("prefill", min(args.prefill, ctx)), ("decode", 1)):
            q, qpos, pieces, slots, kc, vc, realigner = _case(ctx, tq, args, device, dtype, gen)
            scale = args.head_dim ** -0.5
            desc = pack_view(pieces, realigner, device)
            view = build_gathered(pieces, realigner, device, dtype)
            ref = gathered_attention(q, view, kc, vc, 0, scale)
            out = view_attention_fwd(q, qpos, kc, vc, desc, 0, scale)
            err = (out.float() - ref.float()).abs().max().item()
            k_exact, v_exact = kc[slots].contiguous(), vc[slots].contiguous()
            kv_bytes = 2 * k_exact.numel() * k_exact.element_size()
            rows += [
                Row(ctx, phase, tq, "kernel", timed(lambda: view_attention_fwd(q, qpos, kc, vc, desc, 0, scale)),
                    err, desc.nbytes),
                Row(ctx, phase, tq, "pack_view", timed(lambda: pack_view(pieces, realigner, device)), None,
                    desc.nbytes),
                Row(ctx, phase, tq, "sdpa_view", timed(lambda: gathered_attention(q, view, kc, vc, 0, scale)),
                    0.0, kv_bytes),
                Row(ctx, phase, tq, "sdpa_exact", timed(lambda: sdpa(q, k_exact, v_exact, scale)), None, 0),
            ]
            del k_exact, v_exact
            print(f"ctx {ctx:>6} {phase:<7} " + "  ".join(f"{r.method} {r.ms:.3f} ms" for r in rows[-4:]),
                  flush=True)
    return rows


def _markdown(rows: list[Row], meta: dict) -> str:
    lines = [f"# Kernel microbenchmark ({meta['device_name']}, {meta['dtype']})", "",
             f"{meta['heads']} query heads / {meta['kv_heads']} KV heads / head_dim {meta['head_dim']}; "
             f"{meta['segments']} reused segments, rank-{meta['rank']} corrections on {meta['row_frac']:.0%} "
             f"of their rows. Median of {meta['iters']} runs, one layer. err = max |kernel - sdpa_view|.", "",
             "| context | phase | queries | kernel ms | pack ms | sdpa_view ms | sdpa_exact ms | err |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    by = {(r.context, r.phase, r.method): r for r in rows}
    for ctx, phase in dict.fromkeys((r.context, r.phase) for r in rows):
        k = by[(ctx, phase, "kernel")]
        lines.append(f"| {ctx} | {phase} | {k.queries} | {k.ms:.3f} | {by[(ctx, phase, 'pack_view')].ms:.3f} | "
                     f"{by[(ctx, phase, 'sdpa_view')].ms:.3f} | {by[(ctx, phase, 'sdpa_exact')].ms:.3f} | "
                     f"{k.max_abs_err:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--prefill", type=int, default=512, help="queries in the prefill case")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--row-frac", type=float, default=0.3)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one iteration (CPU interpreter smoke run)")
    ap.add_argument("--out", default="benchmarks/results/kernel", help="folder for kernel_bench.json/.md")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")    # before the kernel module is imported
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.quick:
        args.contexts, args.prefill, args.heads, args.kv_heads, args.head_dim = [80, 200], 16, 4, 2, 64
        args.segments, args.warmup, args.iters = 2, 0, 1

    rows = bench(args)
    dev = torch.device(args.device)
    meta = {**{k: v for k, v in vars(args).items() if k != "out"},
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "interpreter": os.environ.get("TRITON_INTERPRET", "0"), "torch": torch.__version__,
            "triton": __import__("triton").__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "kernel_bench.md").write_text(_markdown(rows, meta))
    print(f"wrote {out / 'kernel_bench.json'} and {out / 'kernel_bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
