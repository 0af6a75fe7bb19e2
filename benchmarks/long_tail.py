"""TTFT of a later agent whose own tail is a long new message (a tool's output), by reuse mode.

Agent A computes a shared history; agent B's prompt is that history plus a long tool output it has not
seen. ``none`` prefills all of it; ``prefix`` too (B has no earlier prompt); ``kvcmas`` reuses A's view
of the history, selects rows to recompute by the tail's attention (at most its last
``correction.SELECT_MAX`` tokens), corrects them and prefills the tail. Prints one JSON object: each
mode's TTFT, its ratio to ``none``, the tokens reused and recomputed, and B's first-token KL against
``none``. The modes run one after another in one process, so the ratios are side by side.

    python -m benchmarks.long_tail [--shared 1100] [--tail 3200]
"""
from __future__ import annotations

import argparse
import asyncio
import json

from kvcmas_agents.engine import Engine, EngineConfig, SamplingParams
from kvcmas_agents.fidelity import kl
from kvcmas_agents import KVCMASConfig

FIRST = SamplingParams(max_tokens=1, return_logits=True)
SYSTEM = {"a": "You are agent A. You plan.", "b": "You are agent B. You debug."}


def _text(line: str, tokens: int) -> str:
    """About ``tokens`` tokens of numbered lines (SmolLM2's tokenizer: ~22 tokens a line)."""
    return "\n".join(line.format(i=i, m=i % 5, t=10 + i % 37, d=i % 11) for i in range(max(1, tokens // 22)))


async def run(shared_tokens: int, tail_tokens: int, recompute_ratio: float | None = None) -> dict:
    shared = [{"role": "user", "content": "Task: find why the service is slow.\n"
               + _text("Note {i}: the service reads queue q{m} and writes table t{d} after {t} ms.", shared_tokens)},
              {"role": "user", "content": "Round 1: look at the logs below."}]
    tail = [{"role": "user", "content": "Tool output:\n"
             + _text("Log {i}: worker w{m} processed batch b{i} in {t} ms, queue depth {d}.", tail_tokens)}]
    result: dict = {"shared_tokens": shared_tokens, "tail_tokens": tail_tokens, "modes": {}}
    ref = None
    for mode in ("none", "prefix", "kvcmas"):
        knobs = {} if recompute_ratio is None else {"recompute_ratio": recompute_ratio}
        engine = Engine(EngineConfig(reuse=mode, kvcmas=KVCMASConfig(prefetch=False, **knobs)))
        try:
            await engine.generate([{"role": "system", "content": SYSTEM["a"]}] + shared, agent="a", sampling=FIRST)
            out = await engine.generate([{"role": "system", "content": SYSTEM["b"]}] + shared + tail, agent="b",
                                        sampling=FIRST)
            stats = engine.stats()
        finally:
            await engine.aclose()
        ref = ref if ref is not None else out
        result["modes"][mode] = {
            "ttft_s": out.ttft_s, "vs_none": ref.ttft_s / out.ttft_s, "prompt_tokens": out.usage.prompt_tokens,
            "reused_tokens": out.usage.reused_tokens, "recomputed_tokens": out.usage.recomputed_tokens,
            "selections_capped": stats["reuse"]["kvcmas"]["selections_capped"],
            "selections_skipped": stats["reuse"]["kvcmas"]["selections_skipped"],
            "first_token_kl": kl(ref.logits[0], out.logits[0])}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=int, default=1100, help="tokens of shared history (about)")
    p.add_argument("--tail", type=int, default=3200, help="tokens of the later agent's new tail (about)")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.shared, args.tail)), indent=1))


if __name__ == "__main__":
    main()
