"""``kvcmas fidelity``: options, run, write and print the report."""
from __future__ import annotations

import argparse
import asyncio

from ..engine import KVCMASConfig, ReuseOptions, StorageSpec
from ..reuse import names as reuse_modes
from ..reuse.kvcmas.config import DECODE_COPY, RECOMPUTE_DTYPES
from ..reuse.options import REFERENCES
from ..reuse.storage.codec import HEAD_BITS
from ..reuse.storage.quant_rows import BITS as ROW_BITS
from ..reuse.storage.spec import FACTOR_DTYPES, SIDE_BITS
from .harness import SweepGrid, run_fidelity
from .report import history_table, summary_table, sweep_table, write_report
from .scenarios import DEFAULT_SCENARIOS, SCENARIOS, get_scenario

# Quick mode: one round per scenario, short replies, a 3-point sweep (about 3 minutes on 2 CPU cores).
QUICK = {"reply_tokens": 32, "eval_tokens": 16, "ratios": (0.1, 0.3, 1.0), "ranks": (16,)}
# Full mode: 96-token replies grow every shared history past 1,000 tokens; the sweep leaves out 0.75 to
# stay near 20 minutes (``--sweep-ratios`` adds it back).
FULL = {"reply_tokens": 96, "eval_tokens": 64, "ratios": (0.1, 0.2, 0.3, 0.5, 1.0), "ranks": SweepGrid.ranks}


def add_args(parser: argparse.ArgumentParser) -> None:
    from ..demos.engine_pipeline import device_arg
    parser.add_argument("--quick", action="store_true", help="one round per scenario, short replies, small sweep")
    parser.add_argument("--scenarios", nargs="+", default=list(DEFAULT_SCENARIOS), choices=sorted(SCENARIOS))
    parser.add_argument("--modes", nargs="+", default=["naive", "kvcmas", "prefix"], choices=reuse_modes(),
                        help="reuse modes compared with the exact run (prefix is an exact sanity row)")
    parser.add_argument("--reply-tokens", type=int, default=None, help="greedy reply length (96; quick 32)")
    parser.add_argument("--eval-tokens", type=int, default=None,
                        help="teacher-forced continuation length (64; quick 16)")
    parser.add_argument("--recompute-ratio", type=float, default=None, help="kvcmas knob (engine default)")
    parser.add_argument("--rank", type=int, default=None, help="kvcmas knob (engine default)")
    parser.add_argument("--reference", choices=REFERENCES, default=None, help="kvcmas knob (engine default)")
    parser.add_argument("--value-bits", type=int, choices=SIDE_BITS, default=None,
                        help="StorageSpec.value_bits: 0 factors the values (default), 4/6/8 keeps them as rows")
    parser.add_argument("--key-bits", type=int, choices=SIDE_BITS, default=None,
                        help="StorageSpec.key_bits: 0 factors the keys (default), 4/6/8 keeps them as quantized rows")
    parser.add_argument("--no-small-rows", action="store_true",
                        help="StorageSpec.small_rows=False: factor small corrections too")
    parser.add_argument("--small-row-bits", type=int, choices=ROW_BITS, default=None,
                        help="StorageSpec.small_row_bits: code bits of small corrections' rows (engine default)")
    parser.add_argument("--u-head-bits", type=int, choices=HEAD_BITS, default=None,
                        help="StorageSpec.u_head_bits: code bits of U's leading components (engine default)")
    parser.add_argument("--uncorrected-energy", type=float, default=None,
                        help="StorageSpec.uncorrected_energy: leading layers' share of the deviation left "
                             "uncorrected (engine default)")
    parser.add_argument("--correction-dtype", choices=FACTOR_DTYPES, default=None,
                        help="StorageSpec.dtype of the factors (engine default)")
    parser.add_argument("--u8-components", type=_u8, default=None,
                        help="StorageSpec.u8_components: U's components at their head bits, or 'all' (engine default)")
    parser.add_argument("--prefetch-ratio", type=float, default=None,
                        help="KVCMASConfig.prefetch_ratio of ahead-of-time corrections (engine default)")
    parser.add_argument("--decode-copy", choices=DECODE_COPY, default=None,
                        help="KVCMASConfig.decode_copy: decode over a copy of the view (engine default)")
    parser.add_argument("--recompute-dtype", choices=RECOMPUTE_DTYPES, default=None,
                        help="KVCMASConfig.recompute_dtype: the recompute's products (engine default)")
    parser.add_argument("--no-edges", action="store_true",
                        help="do not register the scenarios' edge order with the engines (with --no-declare: "
                             "an engine that nobody told anything)")
    parser.add_argument("--no-declare", action="store_true",
                        help="do not declare the agents' system prompts to the engines before each replay")
    parser.add_argument("--sweep-scenario", default=None, help="scenario of the sweep (default: the first)")
    parser.add_argument("--sweep-ratios", type=float, nargs="+", default=None)
    parser.add_argument("--sweep-ranks", type=int, nargs="+", default=None)
    parser.add_argument("--sweep-eval-tokens", type=int, default=8)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--decode", choices=("full", "window"), default="full",
                        help="replayed turns decode the whole exact reply (full) or only the scored window")
    parser.add_argument("--out", default="benchmarks/results/fidelity", help="output folder")
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", type=device_arg, default="auto", help="auto, cpu, cuda, cuda:N")


def _u8(text: str) -> int | str:
    return text if text == "all" else int(text)


def storage_of(args: argparse.Namespace) -> StorageSpec:
    """The storage knobs given on the command line; the rest at StorageSpec's defaults."""
    given = {"dtype": args.correction_dtype, "small_row_bits": args.small_row_bits, "u_head_bits": args.u_head_bits,
             "uncorrected_energy": args.uncorrected_energy, "value_bits": args.value_bits, "key_bits": args.key_bits}
    out = {k: v for k, v in given.items() if v is not None}
    if args.no_small_rows:
        out["small_rows"] = False
    if args.u8_components is not None:
        out["u8_components"] = None if args.u8_components == "all" else args.u8_components
    return StorageSpec(**out)


def settings_of(args: argparse.Namespace) -> KVCMASConfig:
    """The KVCMAS settings of the replays' engines (the knobs of --recompute-ratio etc. apply per run)."""
    extra = {k: v for k, v in (("prefetch_ratio", args.prefetch_ratio), ("decode_copy", args.decode_copy),
                               ("recompute_dtype", args.recompute_dtype)) if v is not None}
    return KVCMASConfig(storage=storage_of(args), **extra)


def run(args: argparse.Namespace) -> int:
    preset = QUICK if args.quick else FULL
    scenarios = [get_scenario(name, quick=args.quick) for name in args.scenarios]
    sweep = None if args.no_sweep else SweepGrid(
        args.sweep_scenario or args.scenarios[0], tuple(args.sweep_ratios or preset["ratios"]),
        tuple(args.sweep_ranks or preset["ranks"]), args.sweep_eval_tokens)
    if sweep and sweep.scenario not in args.scenarios:
        raise ValueError(f"--sweep-scenario {sweep.scenario!r} is not among --scenarios")
    result = asyncio.run(run_fidelity(
        scenarios, modes=tuple(args.modes),
        knobs=ReuseOptions(recompute_ratio=args.recompute_ratio, rank=args.rank, reference=args.reference),
        reply_tokens=args.reply_tokens or preset["reply_tokens"], eval_tokens=args.eval_tokens or preset["eval_tokens"],
        sweep=sweep, model=args.model, device=args.device, full_decode=args.decode == "full",
        settings=settings_of(args), declare=not args.no_declare, edges=not args.no_edges))
    result["config"]["quick"] = args.quick
    paths = write_report(result, args.out)
    print(summary_table(result), "", history_table(result), sep="\n")
    if result.get("sweep"):
        print("", sweep_table(result["sweep"]), sep="\n")
    print(f"\n{result['timing']['total_s']:.0f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fidelity", description="Fidelity of cross-agent KV reuse vs exact prefill")
    add_args(parser)
    return run(parser.parse_args(argv))
