"""``kvcmas bench tool-loop``: an agent's continuing turns (a tool loop): what a later agent's next turn costs once it has read a
shared history.

A lead agent computes the shared history of ``team_history`` (about 1,600 tokens); a second agent,
with its own system prompt, reads it with a hand-off and replies (up to ``reply`` tokens, to its stop
token; the same tokens in every mode: prefix's greedy reply, teacher-forced elsewhere). Then the same agent takes ``turns`` more
turns, each its whole previous prompt plus its reply (or a short acknowledgement) and a tool result, as
a LangGraph ReAct agent or an AutoGen assistant with tools sends them. Modes alternate per round on
fresh engines, so the ratios are side by side.

Prints JSON: per mode and turn, TTFT (median over rounds), the prompt tokens it found cached, reused
and computed, and the first-token KL against prefix on the same prompt.

    kvcmas bench tool-loop [--rounds 3] [--reply 40] [--turns 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from ..engine import Engine, EngineConfig, SamplingParams
from ..fidelity import kl
from .team_history import FIRST, LATER, lead_history, prompt

HELP = "an agent's continuing turns (tool results) after reading a shared history: TTFT per turn"

MODES = ("prefix", "kvcmas")
TOOL_RESULTS = ["tool result: 12 of 14 tests passed; failing: test_touching_intervals, test_unsorted_input.",
                "tool result: all 14 tests passed in 0.03 s.", "tool result: coverage 96%, lines 41-42 not run."]


async def one_round(mode: str, reply: int, turns: int, forced: list[int] | None) -> tuple[list[dict], list[int]]:
    """A fresh engine: the lead's history, the agent's first turn (its reply), then ``turns`` tool turns."""
    engine = Engine(EngineConfig(reuse=mode))
    agent, handoff = next(iter(LATER.items()))
    try:
        await lead_history(engine)
        messages = prompt(agent, handoff)
        # The reply ends at its stop token, as a real one does (decoded past it, its text would hold
        # special tokens that the next prompt does not re-encode).
        first = await engine.generate(messages, agent=agent,
                                      sampling=SamplingParams(max_tokens=reply, forced_tokens=forced))
        rows = [_row(first)]
        text = first.text
        ids = first.token_ids + ([engine.tokenizer.convert_tokens_to_ids(first.stop_reason)]
                                 if first.finish_reason == "stop" else [])
        for i in range(turns):
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": TOOL_RESULTS[i % len(TOOL_RESULTS)]}]
            out = await engine.generate(messages, agent=agent, sampling=FIRST)
            rows.append(_row(out))
            text = f"Noted; running check {i + 2}."     # each its own text: a repeat would be reused
        return rows, ids
    finally:
        await engine.aclose()


def _row(out) -> dict:
    u = out.usage
    return {"ttft_s": out.ttft_s, "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "reused_tokens": u.reused_tokens, "recomputed_tokens": u.recomputed_tokens,
            "computed_tokens": u.prompt_tokens - u.cached_tokens - u.reused_tokens + u.recomputed_tokens,
            "logits": out.logits[0] if out.logits is not None else None}


async def measure(rounds: int, reply: int, turns: int) -> dict:
    runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    forced = None
    for _ in range(rounds):
        for mode in MODES:
            rows, ids = await one_round(mode, reply, turns, forced)
            forced = forced or ids             # every later run decodes prefix's first reply
            runs[mode].append(rows)
    out: dict = {"rounds": rounds, "reply_tokens": reply, "modes": {}}
    exact = runs["prefix"][0]
    for mode, rs in runs.items():
        per_turn = []
        for i in range(turns + 1):
            r0 = rs[0][i]
            ttft = statistics.median(r[i]["ttft_s"] for r in rs)
            per_turn.append({"turn": i, "ttft_ms": round(ttft * 1e3, 1),
                             "vs_prefix": statistics.median(p[i]["ttft_s"] for p in runs["prefix"]) / ttft,
                             **{k: r0[k] for k in ("prompt_tokens", "cached_tokens", "reused_tokens",
                                                   "recomputed_tokens", "computed_tokens")},
                             "first_token_kl": None if i == 0 else kl(exact[i]["logits"], r0["logits"])})
        out["modes"][mode] = per_turn
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reply", type=int, default=40, help="most tokens of the agent's first reply")
    parser.add_argument("--turns", type=int, default=2, help="tool turns after the first")


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(measure(args.rounds, args.reply, args.turns)), indent=1))
    return 0
