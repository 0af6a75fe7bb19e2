"""Quick first-token fidelity sweep of cross-agent reuse on the default model.

Three agents (planner, coder, reviewer) build a shared history with exact greedy replies; then each
later agent's first-token distribution under naive / kvcmas reuse (over a recompute_ratio x rank
grid) is compared with an exact prefill by KL divergence. Not the full fidelity harness.

    python -m benchmarks.quick_sweep
"""
from __future__ import annotations

import argparse
import asyncio
import json

import torch

from kvcmas_agents import Engine, EngineConfig, SamplingParams
from kvcmas_agents.engine import ReuseOptions

SYSTEM = {
    "planner": "You are the planner. Break the task into clear numbered steps.",
    "coder": "You are an expert Python programmer. Write clean, correct code.",
    "reviewer": "You are a strict code reviewer. Point out bugs and risks.",
}
TASK = ("Write a Python function that parses a CSV file of sales records (date, region, amount) and returns "
        "total sales per region, sorted descending. Handle missing values and malformed rows gracefully.")
FIRST = SamplingParams(max_tokens=1, return_logits=True)


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    return float((lp.exp() * (lp - lq)).sum())


async def sweep(ratios: list[float], ranks: list[int], reply_tokens: int) -> list[dict]:
    engine = Engine(EngineConfig(reuse="none"))
    history = [{"role": "user", "content": TASK}]
    for agent in SYSTEM:
        out = await engine.generate([{"role": "system", "content": SYSTEM[agent]}] + history, agent=agent,
                                    sampling=SamplingParams(max_tokens=reply_tokens))
        history.append({"role": "user", "content": f"[{agent}] {out.text}"})
    prompt = lambda a: [{"role": "system", "content": SYSTEM[a]}] + history  # noqa: E731
    # The leading agent computes every shared segment exactly (its home views).
    await engine.generate(prompt("planner"), agent="planner", sampling=FIRST, reuse_options=ReuseOptions(reuse="naive"))
    rows = []
    for agent in ("coder", "reviewer"):
        exact = await engine.generate(prompt(agent), agent=agent, sampling=FIRST)
        configs = [("naive", 0.0, 0)] + [("kvcmas", r, k) for r in ratios for k in ranks]
        for mode, ratio, rank in configs:
            name = f"{agent}/{mode}/{ratio}/{rank}"      # a fresh agent each time: no held correction
            out = await engine.generate(prompt(agent), agent=name, sampling=FIRST, reuse_options=ReuseOptions(
                reuse=mode, recompute_ratio=ratio, rank=rank or None))
            rows.append({"agent": agent, "mode": mode, "recompute_ratio": ratio, "rank": rank,
                         "prompt_tokens": out.usage.prompt_tokens, "reused_tokens": out.usage.reused_tokens,
                         "recomputed_tokens": out.usage.recomputed_tokens,
                         "first_token_kl": kl(exact.logits[0], out.logits[0])})
    await engine.aclose()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 1.0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--json", help="write rows here")
    args = ap.parse_args(argv)
    rows = asyncio.run(sweep(args.ratios, args.ranks, args.reply_tokens))
    print("| agent | mode | ratio | rank | reused/prompt | recomputed | first-token KL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['agent']} | {r['mode']} | {r['recompute_ratio']} | {r['rank']} | "
              f"{r['reused_tokens']}/{r['prompt_tokens']} | {r['recomputed_tokens']} | {r['first_token_kl']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
