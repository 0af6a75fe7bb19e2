"""``kvcmas bench decode-rate``: decode rate of a later agent over a shared history: prefix against kvcmas's ways of decoding.

A lead agent computes the shared history of ``team_history`` (about 1,600 tokens); a second agent,
with its own system prompt, reads it with a hand-off and takes its first token (its correction is
computed then, nothing ahead of time). Then, per round, each variant decodes that agent's reply again
(``ignore_eos``), rounds interleaved in one process so the ratios are side by side. Each variant runs on
its own fresh engine, closed before the next starts: two engines alive at once hold two OpenMP teams,
and GNU OpenMP then sleeps and wakes on every parallel region, which the view's many small ops pay most
(docs/attention.md, "Threads"):

- ``prefix``: its own exact KV (the history prefilled under its own prefix);
- ``kvcmas``: reading the corrected view, its correction codes unpacked once and kept for the decode
  (the compiled CPU loops of ``kernels.cpu_view`` where they built);
- ``kvcmas-torch``: the same by torch ops alone (``switches.compiled_views`` off);
- ``kvcmas-unkept``: the same, unpacking the codes in every step (``switches.keep_codes`` off);
- ``kvcmas-copy``: the view written into the request's own blocks first (``decode_copy="auto"``);
- ``prefix-ops`` and ``kvcmas-ops``: prefix and kvcmas with each decode layer's RoPE, KV write and
  attention as separate ops, as before they became one call (``switches.rope_write`` off).

Prints JSON: per variant, tok/s after the first token (per round and median), its median per-round
ratio to prefix, and what the decode held besides the KV it shares (kept codes, or the copy's blocks).

    kvcmas bench decode-rate [--rounds 5] [--tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from ..engine import Engine, EngineConfig, KVCMASConfig, SamplingParams
from ..fidelity.caller_thread import single_threaded_caller
from ..switches import off as switches_off
from .team_history import LATER, lead_history, prompt

HELP = "a later agent's decode rate over a shared history: prefix against kvcmas's ways of decoding"

VARIANTS = {"prefix": ("prefix", {}), "kvcmas": ("kvcmas", {}), "kvcmas-torch": ("kvcmas", {}),
            "kvcmas-unkept": ("kvcmas", {}),
            "kvcmas-copy": ("kvcmas", {"decode_copy": "auto"}), "prefix-ops": ("prefix", {}),
            "kvcmas-ops": ("kvcmas", {})}
# The fast paths each variant turns off (``switches``) while it decodes.
OFF = {"kvcmas-torch": ("compiled_views",), "kvcmas-unkept": ("keep_codes",), "prefix-ops": ("rope_write",),
       "kvcmas-ops": ("rope_write",)}


async def _engine(mode: str, knobs: dict, threads: int) -> Engine:
    engine = Engine(EngineConfig(reuse=mode, num_threads=threads,
                                 methods={"kvcmas": KVCMASConfig(prefetch="off", **knobs)}))
    agent, handoff = next(iter(LATER.items()))
    await lead_history(engine)
    await engine.generate(prompt(agent, handoff), agent=agent, sampling=SamplingParams(max_tokens=1))
    return engine


async def _decode(engine: Engine, tokens: int) -> tuple[float, int, dict]:
    """One decode of the later agent: (tok/s after the first token, reused tokens, stats mid-decode)."""
    agent, handoff = next(iter(LATER.items()))
    seen, mid = 0, {}
    async for delta in engine.stream(prompt(agent, handoff), agent=agent,
                                     sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)):
        seen += len(delta.token_ids)
        if not mid and seen >= tokens // 2:
            mid = engine.stats()
        out = delta.output
    return (out.usage.completion_tokens - 1) / (out.latency_s - out.ttft_s), out.usage.reused_tokens, mid


async def measure(rounds: int, tokens: int, variants: dict[str, tuple[str, dict]] = VARIANTS) -> dict:
    rates: dict[str, list[float]] = {name: [] for name in variants}
    held: dict[str, int] = {}
    reused: dict[str, int] = {}
    with single_threaded_caller() as threads:
        for _ in range(rounds):
            for name, (mode, knobs) in variants.items():
                engine = await _engine(mode, knobs, threads)
                try:
                    with switches_off(*OFF.get(name, ())):
                        rate, reused[name], mid = await _decode(engine, tokens)
                finally:
                    await engine.aclose()
                rates[name].append(rate)
                kv = mid.get("reuse", {}).get("kvcmas", {})
                held[name] = kv.get("kept_code_bytes", 0) + kv.get("decode_copy_blocks", 0) // max(
                    kv.get("decode_copies", 1), 1) * mid["memory"]["block_bytes"]
    out: dict = {"rounds": rounds, "tokens": tokens, "variants": {}}
    for name, rs in rates.items():
        ratios = [r / p for r, p in zip(rs, rates["prefix"])]
        out["variants"][name] = {"tok_s": rs, "tok_s_median": statistics.median(rs),
                                 "vs_prefix_median": statistics.median(ratios), "reused_tokens": reused[name],
                                 "held_bytes_while_decoding": held[name]}
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each variant decodes a round")


def run(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(measure(args.rounds, args.tokens)), indent=1))
    return 0
