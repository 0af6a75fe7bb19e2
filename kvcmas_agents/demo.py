"""A small multi-agent coding pipeline (planner -> coder -> reviewer -> tester) on one shared Engine.

Every agent sees one shared, growing conversation: its own system prompt, the task, then all earlier
replies in order. The agent's own earlier replies appear as ``assistant`` messages and everyone else's
as ``user`` messages prefixed with ``[name]``. Nothing is ever inserted before or rewritten, so each
agent's next prompt extends its previous prompt plus its own reply, and the per-agent prefix cache
serves that part again from round 2 on.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Callable

from .engine import Engine, EngineConfig, SamplingParams
from .engine.config import REUSE_MODES

AGENTS: dict[str, str] = {
    "planner": ("You are the planner in a small software team. Break the task into at most three short "
                "numbered steps. Do not write code. If the reviewer or tester gave feedback, update the plan."),
    "coder": ("You are the coder in a small software team. Write one short Python function that solves the "
              "task, following the plan and any review feedback. Reply with only a code block."),
    "reviewer": ("You are the code reviewer in a small software team. In one or two sentences, point out the "
                 "most important bug or improvement in the coder's latest code."),
    "tester": ("You are the tester in a small software team. Write two or three short assert statements "
               "that test the coder's latest function. Reply with only a code block."),
}
ORDER: tuple[str, ...] = tuple(AGENTS)
DEFAULT_TASK = ("Write a Python function is_palindrome(s: str) -> bool that ignores case "
                "and non-alphanumeric characters.")

History = list[tuple[str, str]]          # (agent, reply text), in conversation order
TurnCallback = Callable[[dict[str, Any]], None]


def build_messages(agent: str, task: str, history: History) -> list[dict[str, str]]:
    """The prompt one agent sees: its system prompt, the task, then the shared history."""
    messages = [{"role": "system", "content": AGENTS[agent]}, {"role": "user", "content": f"Task: {task}"}]
    for name, text in history:
        if name == agent:
            messages.append({"role": "assistant", "content": text})
        else:
            messages.append({"role": "user", "content": f"[{name}] {text}"})
    return messages


async def run_turn(engine: Engine, agent: str, task: str, history: History, round_no: int,
                   max_tokens: int) -> dict[str, Any]:
    """Run one agent on a snapshot of the history and return its per-turn record."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = await engine.generate(build_messages(agent, task, history), agent=agent, sampling=sampling)
    u = out.usage
    return {
        "round": round_no, "agent": agent, "text": out.text, "finish_reason": out.finish_reason,
        "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens, "ttft_ms": out.ttft_s * 1000.0,
        "latency_s": out.latency_s,
        "tokens_per_s": u.completion_tokens / out.latency_s if out.latency_s > 0 else 0.0,
    }


async def run_pipeline(engine: Engine, task: str, rounds: int, max_tokens: int,
                       parallel_review: bool = False, on_turn: TurnCallback | None = None) -> list[dict]:
    """Run ``rounds`` rounds of planner -> coder -> reviewer -> tester; return one record per turn.

    With ``parallel_review`` the reviewer and tester run concurrently on the same history (so they
    are batched together by the engine) and the tester does not see the reviewer's reply.
    """
    history: History = []
    records: list[dict] = []

    def done(rec: dict[str, Any], parallel: bool = False) -> None:
        rec["parallel"] = parallel
        history.append((rec["agent"], rec["text"]))
        records.append(rec)
        if on_turn:
            on_turn(rec)

    for r in range(1, rounds + 1):
        for agent in ("planner", "coder"):
            done(await run_turn(engine, agent, task, history, r, max_tokens))
        if parallel_review:
            snapshot = list(history)
            pair = await asyncio.gather(*(run_turn(engine, a, task, snapshot, r, max_tokens)
                                          for a in ("reviewer", "tester")))
            for rec in pair:
                done(rec, parallel=True)
        else:
            for agent in ("reviewer", "tester"):
                done(await run_turn(engine, agent, task, history, r, max_tokens))
    return records


# --- printing -------------------------------------------------------------------------------
def shorten(text: str, max_lines: int = 10, max_chars: int = 600) -> str:
    """Trim a reply for display, marking what was cut."""
    text = text.strip() or "(empty reply)"
    lines = text.splitlines()
    cut = len(lines) > max_lines or len(text) > max_chars
    text = "\n".join(lines[:max_lines])[:max_chars].rstrip()
    return text + (" [...]" if cut else "")


def print_turn(rec: dict[str, Any]) -> None:
    """Print one agent's reply under a header line."""
    tag = " (parallel)" if rec.get("parallel") else ""
    print(f"\n--- round {rec['round']} · {rec['agent']}{tag} " + "-" * 40)
    for line in shorten(rec["text"]).splitlines():
        print(f"  {line}")


def format_table(records: list[dict]) -> str:
    """A fixed-width table: one row per turn."""
    head = f"{'round':>5}  {'agent':<9} {'prompt':>6} {'cached':>6} {'new':>4} {'TTFT ms':>8} {'tok/s':>6}  finish"
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(f"{r['round']:>5}  {r['agent']:<9} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
                    f"{r['completion_tokens']:>4} {r['ttft_ms']:>8.1f} {r['tokens_per_s']:>6.1f}  "
                    f"{r['finish_reason']}")
    return "\n".join(rows)


def format_stats(stats: dict[str, Any]) -> str:
    """A few summary lines from ``engine.stats()``."""
    mib = 1024 ** 2
    prompt = stats.get("prompt_tokens", 0)
    hits = stats.get("prefix_hit_tokens", 0)
    ratio = 100.0 * hits / prompt if prompt else 0.0
    return "\n".join([
        f"model {stats['model']} on {stats['device']} ({stats['dtype']}), reuse={stats['reuse']}",
        f"KV cache: {stats['kv_bytes'] / mib:.1f} MiB now, {stats['kv_bytes_peak'] / mib:.1f} MiB peak "
        f"(budget {stats['kv_budget_bytes'] / mib:.0f} MiB, {stats['blocks_cached']} cached blocks)",
        f"prefix hits: {hits} of {prompt} prompt tokens ({ratio:.0f}%)",
        f"requests: {stats.get('completed', 0)} done, {stats.get('completion_tokens', 0)} tokens generated, "
        f"largest batch {stats.get('max_batch_seqs', 0)} sequences",
    ])


# --- command line ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``kvcmas demo`` and ``examples/engine_pipeline.py``."""
    parser.add_argument("--rounds", type=int, default=2, help="pipeline rounds (default 2)")
    parser.add_argument("--max-tokens", type=int, default=96, help="max new tokens per turn (default 96)")
    parser.add_argument("--reuse", choices=REUSE_MODES, default="prefix", help="KV reuse mode (default prefix)")
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--task", default=DEFAULT_TASK, help="the coding task to work on")
    parser.add_argument("--parallel-review", action="store_true",
                        help="run reviewer and tester concurrently on the same history")


def run(args: argparse.Namespace) -> int:
    """Build an engine, run the pipeline, print replies, the per-turn table and engine stats."""
    if args.rounds < 1 or args.max_tokens < 1:
        raise ValueError("--rounds and --max-tokens must be positive")
    engine = Engine(EngineConfig(model=args.model, device=args.device, reuse=args.reuse))
    try:
        print(f"task: {args.task}")
        start = time.perf_counter()
        records = asyncio.run(run_pipeline(engine, args.task, args.rounds, args.max_tokens,
                                           args.parallel_review, on_turn=print_turn))
        elapsed = time.perf_counter() - start
        print(f"\n{format_table(records)}\n")
        print(format_stats(engine.stats()))
        print(f"wall time: {elapsed:.1f} s")
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``examples/engine_pipeline.py``."""
    parser = argparse.ArgumentParser(description="planner -> coder -> reviewer -> tester on one kvcmas Engine")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
