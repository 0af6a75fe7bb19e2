"""Quick recompute_ratio x rank sweep on the short CSV coding conversation (planner -> coder -> reviewer).

A thin wrapper over the fidelity harness (``python -m benchmarks.fidelity``), which replays each setting
on a fresh engine and reports first-token and teacher-forced KL against exact prefill:

    python -m benchmarks.quick_sweep [--ratios 0.1 0.2 0.3 0.5 1.0] [--ranks 8 16] [--reply-tokens 48]
"""
from __future__ import annotations

import argparse
import sys

from kvcmas_agents.fidelity.cli import main as fidelity_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 1.0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--eval-tokens", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/quick_sweep", help="report folder")
    args = ap.parse_args(argv)
    return fidelity_main([
        "--scenarios", "csv", "--modes", "naive", "kvcmas", "--reply-tokens", str(args.reply_tokens),
        "--eval-tokens", str(args.eval_tokens), "--sweep-eval-tokens", str(args.eval_tokens),
        "--sweep-ratios", *map(str, args.ratios), "--sweep-ranks", *map(str, args.ranks), "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
