"""``kvcmas bench``: options, run, write and print the report; ``kvcmas bench NAME``: one of the
narrower benchmarks in ``SUBCOMMANDS``, each a module with ``HELP``, ``add_args(parser)`` and
``run(args) -> int``."""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys

from . import decode_rate, grammar_mask, parts, scale_out, soak, tool_choice, tool_loop, turn_time
from .methods import DEFAULT_METHODS, METHODS, Method, sweep_methods
from .report import markdown, write_report
from .runner import BenchConfig, run_bench
from .traces import PRESETS, get_traces

# Per preset: recompute ratios, ranks and prefetch ratios swept (other knobs at engine defaults), and
# whether to add a run without ahead-of-time corrections. On the full pipeline the ahead-of-time
# corrections cover the reused history, so recompute_ratio moves little there (a bf16 run measured
# 0.25, 0.35 and 0.5 to the same KL): prefetch_ratio and rank are the knobs that trade fidelity for
# memory and time.
SWEEP = {"quick": ((0.2, 1.0), (), (), True), "full": ((0.3,), (24, 32), (0.5,), True),
         "long": ((), (), (), True), "tiny": ((), (), (), False)}

SUBCOMMANDS = {"parts": parts, "turn-time": turn_time, "tool-loop": tool_loop, "decode-rate": decode_rate,
               "tool-choice": tool_choice, "grammar-mask": grammar_mask, "soak": soak, "scale-out": scale_out}


def add_args(parser: argparse.ArgumentParser) -> None:
    from ..demos.engine_pipeline import device_arg
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full",
                        help="quick: 1-round traces (CI smoke); full: shared history >= 2,000 tokens; "
                             "long: >= 8,000 tokens (GPU)")
    parser.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    parser.add_argument("--traces", nargs="+", default=None, help="only these traces of the preset")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    parser.add_argument("--eval-tokens", type=int, default=16, help="teacher-forced tokens scored per turn")
    parser.add_argument("--decode", choices=("full", "window"), default="full",
                        help="replayed turns decode the whole exact reply (full, as agents do) or only the "
                             "scored window")
    parser.add_argument("--throughput-tokens", type=int, default=32, help="decode tokens per agent (0: skip)")
    parser.add_argument("--sweep-ratios", type=float, nargs="*", default=None)
    parser.add_argument("--sweep-ranks", type=int, nargs="*", default=None)
    parser.add_argument("--sweep-prefetch-ratios", type=float, nargs="*", default=None,
                        help="prefetch_ratio values swept (ahead-of-time corrections' recompute ratio)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kvcmas knob sweep")
    parser.add_argument("--kv-budget-mib", type=int, default=None, help="KV budget per engine (default 2 GiB)")
    parser.add_argument("--out", default="benchmarks/results/bench", help="output folder")
    parser.add_argument("--model", default=None, help="checkpoint dir, .gguf, or random:<shape> (GPU speed runs)")
    parser.add_argument("--device", type=device_arg, default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--no-undeclared", action="store_true",
                        help="skip the replays of none/prefix/kvcmas with no edges and no declarations")
    parser.add_argument("--no-declare", action="store_true",
                        help="do not declare the agents' system prompts to the engines before each replay")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="model and KV dtype (default: bf16 on CUDA, fp32 on CPU); bfloat16 on CPU "
                             "measures the memory a GPU run holds")
    subs = parser.add_subparsers(dest="bench_name", metavar="NAME", title="narrower benchmarks",
                                 description="kvcmas bench NAME --help for each one's options; without NAME, "
                                             "the replay of every method above")
    for name, module in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=module.HELP, description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(sub)


def sweep_of(args: argparse.Namespace) -> list[Method]:
    """The kvcmas knob sweep: the preset's, with any axis the options give replaced."""
    if args.no_sweep:
        return []
    ratios, ranks, prefetch_ratios, no_prefetch = SWEEP[args.preset]
    given = (args.sweep_ratios, args.sweep_ranks, args.sweep_prefetch_ratios)
    ratios, ranks, prefetch_ratios = (tuple(g) if g is not None else d
                                      for g, d in zip(given, (ratios, ranks, prefetch_ratios)))
    return sweep_methods(ratios, ranks, prefetch_ratios, no_prefetch)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_name", None):
        return SUBCOMMANDS[args.bench_name].run(args)
    traces = get_traces(args.preset, args.traces)
    sweep = sweep_of(args)
    cfg = BenchConfig(traces, list(args.methods), sweep, traces[0].name, args.eval_tokens, args.decode == "full",
                      args.throughput_tokens, args.model, args.device,
                      args.kv_budget_mib * 2**20 if args.kv_budget_mib else None, args.dtype,
                      declare=not args.no_declare, undeclared=not args.no_undeclared)
    result = asyncio.run(run_bench(cfg))
    result["config"]["preset"] = args.preset
    command = "kvcmas bench " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else ""
    paths = write_report(result, args.out, command)
    print(markdown(result, command))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description="TTFT, memory, throughput and fidelity by method")
    add_args(parser)
    return run(parser.parse_args(argv))
