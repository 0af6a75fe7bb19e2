"""A small multi-agent coding pipeline (planner -> coder -> reviewer -> tester) on one shared Engine.

Every agent sees one shared, growing conversation: its own system prompt, the task, then the history.
Before each turn a moderator message (a plain ``user`` message) hands the turn to the next agent.
An agent's own earlier replies appear as ``assistant`` messages and everyone else's as ``user``
messages headed ``[name]``. The history is only ever appended to, so each agent's next prompt extends
its previous prompt plus its own reply, and the per-agent prefix cache serves that part from round 2 on.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..engine import Engine, EngineConfig, InvalidRequestError, ModelNotFoundError, SamplingParams
from ..reuse import names as reuse_modes


@dataclass(frozen=True)
class Role:
    """One agent: its system prompt, the hand-off message that gives it the turn, and stop strings."""

    system: str
    handoff: str
    revise: str              # hand-off used from round 2 on
    stop: tuple[str, ...] = ()


AGENTS: dict[str, Role] = {
    "planner": Role(
        "You are the planner in a small software team. You write short plans in plain English, never code.",
        "planner: how should the coder solve this? Answer in plain English, two sentences.",
        "planner: given the review and the tests, what should the coder change? Answer in plain English, "
        "two sentences.",
        stop=("\n\n",)),
    "coder": Role(
        "You are the coder in a small software team. You write short, correct Python.",
        "coder: write the Python function, following the plan. Reply with only a ```python code block.",
        "coder: write the updated Python function. Reply with only a ```python code block.",
        stop=("\n```",)),
    "reviewer": Role(
        "You are the code reviewer in a small software team. You are brief and specific.",
        "reviewer: in one or two sentences, name the most important problem in the coder's latest code.",
        "reviewer: in one or two sentences, say whether the coder's new code fixes the problems.",
        stop=("\n\n",)),
    "tester": Role(
        "You are the tester in a small software team. You think about edge cases.",
        "tester: what edge cases should the coder's function handle? Name three, one short sentence each.",
        "tester: which edge cases does the coder's new function still miss? Name up to three, one short "
        "sentence each."),
}
ORDER: tuple[str, ...] = tuple(AGENTS)
MODERATOR = "moderator"
DEFAULT_TASK = ("Write a Python function is_palindrome(s: str) -> bool that ignores case "
                "and non-alphanumeric characters.")

History = list[tuple[str, str]]          # (speaker, text) in conversation order
TurnCallback = Callable[[dict[str, Any]], None]


def build_messages(agent: str, task: str, history: History) -> list[dict[str, str]]:
    """The prompt one agent sees: its system prompt, the task, then the shared history."""
    messages = [{"role": "system", "content": AGENTS[agent].system},
                {"role": "user", "content": f"Task: {task}"}]
    for speaker, text in history:
        if speaker == agent:
            messages.append({"role": "assistant", "content": text})
        elif speaker == MODERATOR:
            messages.append({"role": "user", "content": text})
        else:
            messages.append({"role": "user", "content": f"[{speaker}]\n{text}"})
    return messages


def handoff(agent: str, round_no: int) -> tuple[str, str]:
    """The moderator message that gives ``agent`` the turn."""
    role = AGENTS[agent]
    return MODERATOR, role.handoff if round_no == 1 else role.revise


def clean_reply(agent: str, text: str) -> str:
    """Close a code block cut at its closing fence by a stop string."""
    if "\n```" in AGENTS[agent].stop and text.count("```") % 2 == 1:
        return text.rstrip() + "\n```"
    return text


async def run_turn(engine: Engine, agent: str, task: str, history: History, round_no: int,
                   max_tokens: int) -> dict[str, Any]:
    """Run one agent on a snapshot of the history (ending with its hand-off); return its record."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=list(AGENTS[agent].stop))
    out = await engine.generate(build_messages(agent, task, history), agent=agent, sampling=sampling)
    u = out.usage
    return {
        "round": round_no, "agent": agent, "text": clean_reply(agent, out.text),
        "finish_reason": out.finish_reason,
        "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens, "reused_tokens": u.reused_tokens,
        "completion_tokens": u.completion_tokens, "ttft_ms": out.ttft_s * 1000.0,
        "latency_s": out.latency_s,
        "tokens_per_s": u.completion_tokens / out.latency_s if out.latency_s > 0 else 0.0,
    }


async def run_pipeline(engine: Engine, task: str, rounds: int, max_tokens: int,
                       parallel_review: bool = False, on_turn: TurnCallback | None = None) -> list[dict]:
    """Run ``rounds`` rounds of planner -> coder -> reviewer -> tester; return one record per turn.

    Before each turn a moderator message hands the turn to the next agent; it stays in the shared
    history. With ``parallel_review`` the reviewer and tester run concurrently on the same history
    (batched together by the engine), so the tester does not see the reviewer's reply.
    """
    tail = [("coder", "reviewer"), ("coder", "tester")] if parallel_review else [("coder", "reviewer"),
                                                                               ("reviewer", "tester")]
    engine.set_edges([("planner", "coder"), *tail])
    history: History = []
    records: list[dict] = []

    def done(rec: dict[str, Any], parallel: bool = False) -> None:
        rec["parallel"] = parallel
        records.append(rec)
        if on_turn:
            on_turn(rec)

    for r in range(1, rounds + 1):
        sequential = ORDER[:2] if parallel_review else ORDER
        for agent in sequential:
            history.append(handoff(agent, r))
            rec = await run_turn(engine, agent, task, history, r, max_tokens)
            history.append((agent, rec["text"]))
            done(rec)
        if parallel_review:
            pair = ("reviewer", "tester")
            recs = await asyncio.gather(*(run_turn(engine, a, task, history + [handoff(a, r)], r, max_tokens)
                                          for a in pair))
            for agent, rec in zip(pair, recs):
                history += [handoff(agent, r), (agent, rec["text"])]
                done(rec, parallel=True)
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
    """A fixed-width table: one row per turn (a "reused" column appears when any turn reused KV)."""
    reused = any(r.get("reused_tokens") for r in records)
    head = (f"{'round':>5}  {'agent':<9} {'prompt':>6} {'cached':>6}" + (f" {'reused':>6}" if reused else "")
            + f" {'new':>4} {'TTFT ms':>8} {'tok/s':>6}  finish")
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(f"{r['round']:>5}  {r['agent']:<9} {r['prompt_tokens']:>6} {r['cached_tokens']:>6}"
                    + (f" {r.get('reused_tokens', 0):>6}" if reused else "")
                    + f" {r['completion_tokens']:>4} {r['ttft_ms']:>8.1f} {r['tokens_per_s']:>6.1f}  "
                    f"{r['finish_reason']}")
    return "\n".join(rows)


def format_stats(stats: dict[str, Any]) -> str:
    """A few summary lines from ``engine.stats()``."""
    mib = 1024 ** 2
    e, m, c = stats["engine"], stats["memory"], stats["counters"]
    prompt, hits = c["prompt_tokens"], c["cached_tokens"]
    ratio = 100.0 * hits / prompt if prompt else 0.0
    return "\n".join([
        f"model {e['model']} on {e['device']} ({e['dtype']}), reuse={e['reuse']}",
        f"KV cache: {m['kv_bytes'] / mib:.1f} MiB now, {m['kv_bytes_peak'] / mib:.1f} MiB peak "
        f"(budget {m['kv_budget_bytes'] / mib:.0f} MiB, {m['blocks_cached']} cached blocks)",
        f"prefix hits: {hits} of {prompt} prompt tokens ({ratio:.0f}%)",
        f"requests: {c['completed']} done, {c['completion_tokens']} tokens generated, "
        f"largest batch {c['max_batch_seqs']} sequences",
    ])


# --- command line ---------------------------------------------------------------------------
def device_arg(value: str) -> str:
    """argparse type for --device: "auto" or anything torch.device accepts."""
    if value != "auto":
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"invalid device {value!r}; use auto, cpu, cuda or cuda:N") from None
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``kvcmas demo`` and ``examples/engine_pipeline.py``."""
    parser.add_argument("--rounds", type=int, default=2, help="pipeline rounds (default 2)")
    parser.add_argument("--max-tokens", type=int, default=96, help="max new tokens per turn (default 96)")
    parser.add_argument("--reuse", choices=reuse_modes(), default="prefix", help="KV reuse mode (default prefix)")
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", type=device_arg, default="auto",
                        help="auto, cpu, cuda, cuda:N (default auto)")
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
    except (ModelNotFoundError, InvalidRequestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
