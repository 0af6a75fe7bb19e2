"""``kvcmas bench grammar-mask``: per-token cost of grammar-constrained decoding (docs/structured_output.md).

Two figures on the default model's tokenizer (vocab 49,152):
  mask   - what the sampler adds per constrained row and token: filling the row's bitmask from its
           matcher, applying it to the logits, and advancing the matcher with the chosen token;
  engine - decode time per token of one greedy request on the real engine, free vs. constrained to
           a JSON schema (the same prompt and token budget).

    kvcmas bench grammar-mask            # CPU; --device cuda on a GPU; --mask-only for the first
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..engine import Engine, EngineConfig, SamplingParams
from ..model.grammar import GrammarSpec, apply_masks

HELP = "per-token cost of grammar-constrained decoding: the mask step, and free vs constrained decode"

SCHEMA = {"type": "object", "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"},
                                           "rating": {"type": "integer"}},
          "required": ["setup", "punchline", "rating"]}
TEXT = json.dumps({"setup": "Why did the cat sit on the computer to watch the little mouse all day?",
                   "punchline": "To keep an eye on the mouse, of course, and to stay warm.", "rating": 7})
FORMAT = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Tell me a joke about cats, as JSON."}]


def mask_cost(engine: Engine, repeats: int) -> dict[str, float]:
    """Microseconds per token for one constrained row: the whole mask step, and its parts."""
    import xgrammar as xgr

    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    spec = GrammarSpec.of(SCHEMA)
    t0 = time.perf_counter()
    engine.grammars.compiled(spec)
    first_ms = (time.perf_counter() - t0) * 1e3
    logits = torch.randn(1, engine.args.vocab_size, device=engine.device)
    total, fill, apply = [], [], []
    for _ in range(repeats):
        state = engine.grammars.state(spec)
        t0 = time.perf_counter()
        for tok in ids:
            apply_masks(logits, [0], [state])        # what the sampler runs: allocate, fill, apply
            assert state.accept(tok)                 # what the worker runs
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        total.append((time.perf_counter() - t0) / len(ids) * 1e6)
        state, bitmask = engine.grammars.state(spec), xgr.allocate_token_bitmask(1, engine.args.vocab_size)
        t_fill = t_apply = 0.0
        for tok in ids:
            t0 = time.perf_counter()
            state.fill(bitmask, 0)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[0])
            t_fill, t_apply = t_fill + t1 - t0, t_apply + time.perf_counter() - t1
            state.accept(tok)
        fill.append(t_fill / len(ids) * 1e6)
        apply.append(t_apply / len(ids) * 1e6)
    return {"tokens": len(ids), "first_compile_ms (import + tokenizer index + compile)": first_ms,
            "mask_us_per_token": statistics.median(total), "fill_us": statistics.median(fill),
            "apply_us": statistics.median(apply)}


def engine_cost(engine: Engine, repeats: int, max_tokens: int = 48) -> dict[str, float]:
    """Median decode milliseconds per token of one greedy request, free vs. constrained to SCHEMA."""
    out = {}
    for name, rf in (("free", None), ("constrained", FORMAT)):
        times = []
        for _ in range(repeats):
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=rf is None, response_format=rf)
            res = engine.generate_sync(MESSAGES, sampling=sampling)
            times.append((res.latency_s - res.ttft_s) / max(1, res.usage.completion_tokens - 1) * 1e3)
        out[f"{name}_ms_per_token"] = statistics.median(times)
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    parser.add_argument("--mask-only", action="store_true", help="skip the engine decode comparison")


def run(args: argparse.Namespace) -> int:
    engine = Engine(EngineConfig(reuse="none", device=args.device, num_threads=args.threads))
    try:
        result = {"device": str(engine.device), "threads": engine.num_threads, **mask_cost(engine, args.repeats)}
        if not args.mask_only:
            result.update(engine_cost(engine, args.repeats))
    finally:
        engine.close()
    print(json.dumps(result, indent=2))
    return 0
