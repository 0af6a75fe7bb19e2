"""``kvcmas bench turn-time``: later agents' first tokens over one shared history, nothing declared.

A lead agent computes the shared history (``team_history``); then three more agents, each with its
own system prompt and no edges or ``declare_agent``, read the same history plus a hand-off, one after
another, and produce their first token. ``prefix`` prefills each later agent's whole prompt (it has no
earlier prompt of its own); ``kvcmas`` reuses the lead's view and corrects it at turn time. Rounds
alternate the modes in one process, so the ratios are side by side.

Prints one JSON object: per mode, each later agent's TTFT (median over rounds), its phases
(``RequestOutput.timings``: plan, select, recompute, compress, forward, ...), tokens reused and
recomputed, and the first-token KL against ``prefix`` (exact).

    kvcmas bench turn-time [--rounds 3] [--ratio 0.5 --ratio 0.2 ...] [--no-newest] [--bf16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from ..engine import Engine, EngineConfig, KVCMASConfig
from ..fidelity import kl
from .team_history import FIRST, LATER, lead_history, prompt

HELP = "later agents' TTFT over one shared history, nothing declared, by phase"


async def one_round(mode: str, kvcmas: KVCMASConfig) -> dict[str, dict]:
    """A fresh engine: the lead computes the history, then each later agent's first token."""
    engine = Engine(EngineConfig(reuse=mode, methods={"kvcmas": kvcmas}))
    try:
        await lead_history(engine)
        outs = {}
        for agent, handoff in LATER.items():
            out = await engine.generate(prompt(agent, handoff), agent=agent, sampling=FIRST)
            outs[agent] = {"ttft_s": out.ttft_s, "timings": out.timings, "prompt_tokens": out.usage.prompt_tokens,
                           "reused_tokens": out.usage.reused_tokens, "recomputed_tokens": out.usage.recomputed_tokens,
                           "logits": out.logits[0]}
        return outs
    finally:
        await engine.aclose()


async def measure(rounds: int, variants: dict[str, tuple[str, KVCMASConfig]]) -> dict:
    """Each variant (name -> (reuse mode, KVCMAS settings); one must be "prefix", the exact reference)
    over ``rounds`` fresh engines, rounds interleaved."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (mode, cfg) in variants.items():
            runs[name].append(await one_round(mode, cfg))
    exact = runs["prefix"][0]
    result: dict = {"rounds": rounds, "modes": {}}
    for name, rs in runs.items():
        agents = {}
        for agent in LATER:
            first = rs[0][agent]
            ttft = statistics.median(r[agent]["ttft_s"] for r in rs)
            phases = {k: statistics.median(r[agent]["timings"].get(k, 0.0) for r in rs)
                      for k in sorted({k for r in rs for k in r[agent]["timings"]})}
            agents[agent] = {"ttft_s": ttft, "phases": phases, "prompt_tokens": first["prompt_tokens"],
                             "reused_tokens": first["reused_tokens"], "recomputed_tokens": first["recomputed_tokens"],
                             "first_token_kl": kl(exact[agent]["logits"], first["logits"]),
                             "same_top1": bool(exact[agent]["logits"].argmax() == first["logits"].argmax())}
        mean = statistics.mean(a["ttft_s"] for a in agents.values())
        result["modes"][name] = {"agents": agents, "ttft_mean_s": mean}
    # the shared history, as the reusing modes saw it (prefix reuses nothing across agents)
    result["history_tokens"] = max(a["reused_tokens"] for m in result["modes"].values() for a in m["agents"].values())
    base = result["modes"]["prefix"]["ttft_mean_s"]
    for m in result["modes"].values():
        m["speedup_vs_prefix"] = base / m["ttft_mean_s"]
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratio", type=float, action="append",
                        help="kvcmas recompute_ratio(s) to run, each a variant (default: the engine's default only)")
    parser.add_argument("--no-newest", action="store_true", help="also run kvcmas without recompute_newest")
    parser.add_argument("--bf16", action="store_true", help="also run kvcmas with recompute_dtype=\"bfloat16\"")


def variants_of(args: argparse.Namespace) -> dict[str, tuple[str, KVCMASConfig]]:
    """prefix, then kvcmas at each ``--ratio`` (each also without recompute_newest with ``--no-newest``)."""
    variants: dict[str, tuple[str, KVCMASConfig]] = {"prefix": ("prefix", KVCMASConfig())}
    for r in args.ratio or [None]:
        name, knobs = ("kvcmas", {}) if r is None else (f"kvcmas@{r}", {"recompute_ratio": r})
        variants[name] = ("kvcmas", KVCMASConfig(**knobs))
        if args.no_newest:
            variants[f"{name}-no-newest"] = ("kvcmas", KVCMASConfig(recompute_newest=False, **knobs))
        if args.bf16:
            variants[f"{name}-bf16"] = ("kvcmas", KVCMASConfig(recompute_dtype="bfloat16", **knobs))
    return variants


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(measure(args.rounds, variants_of(args))), indent=1))
    return 0
