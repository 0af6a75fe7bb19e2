"""Replay every trace through every method on fresh engines; collect TTFT, memory, fidelity, throughput.

Order of work per trace: one exact pass (``reuse="none"``, greedy replies, logits kept), then for each
method a fresh engine replays the same prompts teacher-forced on the exact continuation (so fidelity
is comparable turn by turn and every method sees identical prompts). Methods run one after another
in one process, so their ratios share the machine's state; absolute times mean little on a CPU.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from statistics import fmean, median
from typing import Any, Callable, Iterable

import torch

from ..engine import Engine, SamplingParams
from ..fidelity.conversation import ExactTurn, run_exact_and_close
from ..fidelity.engine_figures import engine_figures
from ..fidelity.replay import ReplayTurn, replay
from ..fidelity.scenarios import declare_systems
from ..fidelity.summary import summarize
from ..fidelity.caller_thread import single_threaded_caller
from .methods import METHODS, Method
from .traces import Trace

Log = Callable[[str], None]
MEMORY_KEYS = ("kv_bytes_peak", "kv_bytes_total_peak", "home_view_bytes", "correction_bytes",
               "correction_basis_bytes", "anchor_bytes")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class BenchConfig:
    traces: list[Trace]
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    sweep: list[Method] = field(default_factory=list)
    sweep_trace: str = "pipeline"
    eval_tokens: int = 16             # teacher-forced tokens scored per turn (fidelity)
    full_decode: bool = True          # decode each whole exact reply, as agents do (else only the window)
    throughput_tokens: int = 32       # decode tokens per agent in the concurrency test (0 skips it)
    model: str | None = None
    device: str = "cpu"
    kv_budget_bytes: int | None = None
    dtype: str | None = None          # None: the engine's default (bf16 on CUDA, fp32 on CPU)
    num_threads: int | None = None    # engines' intra-op threads (None: the caller's torch.get_num_threads())
    declare: bool = True              # declare the agents' system prompts first, as the adapters do
    undeclared: bool = True           # also replay none/prefix/kvcmas with no edges and no declarations


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# Shared history from which a later turn counts as long (the TTFT target is set there).
LONG_SHARED = 1400
PHASES = ("queue", "ahead", "plan", "select", "recompute", "compress", "correct", "forward")


def ttft_summary(turns: list[ReplayTurn], exact: list[ExactTurn] | None = None) -> dict[str, Any]:
    """TTFT over the later turns (those that can reuse another agent's KV), over those with at least
    LONG_SHARED shared tokens, and over all turns; and where the later turns' TTFT went, by phase (mean
    seconds; "correct" counts only what its select/recompute/compress do not, "other" is the rest)."""
    later = [t for t in turns if t.group > 0]
    shared = {t.index: t.shared_tokens for t in exact or []}
    long = [t.ttft_s for t in later if shared.get(t.index, 0) >= LONG_SHARED]
    phases = {p: fmean(t.timings.get(p, 0.0) for t in later) for p in PHASES}
    phases["correct"] -= phases["select"] + phases["recompute"] + phases["compress"]
    phases["other"] = fmean(t.ttft_s for t in later) - sum(phases.values())
    every = [t.ttft_s for t in turns]
    ttfts = [t.ttft_s for t in later]
    return {"ttft_mean": fmean(ttfts), "ttft_p50": median(ttfts), "ttft_p95": _pct(ttfts, 0.95),
            "ttft_long_mean": fmean(long) if long else None, "ttft_long_turns": len(long),
            "ttft_all_mean": fmean(every), "ttft_total": sum(every), "ttft_phases": phases}


class _Bench:
    def __init__(self, cfg: BenchConfig, log: Log, threads: int | None = None):
        self.cfg, self.log, self.threads = cfg, log, threads
        self.cuda = False

    def engine(self, method: Method) -> Engine:
        extra = {"kv_budget_bytes": self.cfg.kv_budget_bytes} if self.cfg.kv_budget_bytes else {}
        if self.cfg.dtype:
            extra["dtype"] = self.cfg.dtype
        engine = Engine(method.config(self.cfg.model, self.cfg.device, num_threads=self.threads, **extra))
        self.cuda = engine.device.type == "cuda"
        return engine

    async def _warm(self, engine: Engine) -> None:
        """Two tiny agents sharing a message, so first-call costs (kernels, SVD) stay out of the timings."""
        history = [{"role": "user", "content": "Warm-up: list three prime numbers and one even number."}]
        for agent in ("_warm_a", "_warm_b"):
            messages = [{"role": "system", "content": f"You are {agent}."}, *history]
            await engine.generate(messages, agent=agent, sampling=SamplingParams(max_tokens=2))
        engine.reset_peak()

    async def replay(self, trace: Trace, exact: list[ExactTurn], method: Method,
                     declared: bool = True) -> dict[str, Any]:
        """One method's replay of the trace; ``declared=False`` registers no edges and declares nothing,
        as a user who never calls set_edges or declare_agent would run it."""
        engine = self.engine(method)
        try:
            if declared:
                engine.set_edges(trace.scenario.edges)
            if declared and self.cfg.declare:
                declare_systems(engine, trace.scenario)
            await self._warm(engine)
            if self.cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            turns = await replay(engine, exact, self.cfg.eval_tokens, self.cfg.full_decode)
            wall = time.perf_counter() - t0
            stats = engine_figures(engine.stats())
            memory = {k: int(stats.get(k, 0)) for k in MEMORY_KEYS}
            if self.cuda:
                memory["cuda_peak_over_pool_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            served = sorted({t.served for t in turns})
            engine_stats = {k: stats.get(k) for k in ("anchors", "anchor_hits", "anchor_misses", "corrections",
                                                      "correction_rows_dropped", "correction_layers_dropped",
                                                      "selections_capped", "selections_skipped", "home_views", "prefetch", "declared")}
        finally:
            await engine.aclose()
        return {"method": method.name, "label": method.label, "reuse": method.reuse, "knobs": asdict(method),
                "declared": declared, "served": served, "wall_s": wall, **ttft_summary(turns, exact),
                "fidelity": summarize(turns),
                "memory": memory, "engine": engine_stats, "turns": [t.to_dict() for t in turns]}

    async def throughput(self, trace: Trace, exact: list[ExactTurn], method: Method) -> dict[str, Any]:
        """Aggregate decode tokens/s of the last turns' agents run concurrently vs one after another."""
        n = self.cfg.throughput_tokens
        last: dict[str, ExactTurn] = {}
        for t in exact:
            last[t.agent] = t
        turns = list(last.values())[-4:]
        sampling = SamplingParams(max_tokens=n, ignore_eos=True)
        engine = self.engine(method)
        try:
            engine.set_edges(trace.scenario.edges)
            await self._warm(engine)
            for t in turns:                     # prime each agent's caches so both runs mostly decode
                await engine.generate(t.messages, agent=t.agent, sampling=SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            seq_outs = [await engine.generate(t.messages, agent=t.agent, sampling=sampling) for t in turns]
            seq = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(t.messages, agent=t.agent, sampling=sampling)
                                          for t in turns))
            conc = time.perf_counter() - t0
            batch = engine.stats()["counters"]["max_batch_seqs"]
        finally:
            await engine.aclose()
        tokens = sum(o.usage.completion_tokens for o in outs)
        # The steps after each first token only: what decoding over the request's view costs, without
        # its setup (plan, correction, the prompt's forward) or ahead-of-time work run before it.
        after_first = sum(o.usage.completion_tokens - 1 for o in seq_outs)
        decode_s = sum(o.latency_s - o.ttft_s for o in seq_outs)
        return {"method": method.name, "agents": [t.agent for t in turns], "tokens_per_agent": n,
                "sequential_s": seq, "concurrent_s": conc, "sequential_tok_s": tokens / seq,
                "sequential_decode_only_tok_s": after_first / decode_s if decode_s > 0 else None,
                "concurrent_tok_s": tokens / conc, "speedup": seq / conc, "max_batch_seqs": batch}


    async def concurrent_memory(self, exact: list[ExactTurn], method: Method, agents: int) -> dict[str, Any]:
        """Peak memory and decode rate while ``agents`` of the trace's last turns decode at once (each its
        own agent, after one turn that builds its corrections): what per-request state costs with
        concurrency (a decode copy of each running request's view, for one)."""
        n = self.cfg.throughput_tokens
        turns = exact[-agents:]
        engine = self.engine(method)
        try:
            await self._warm(engine)
            for t in exact[:-1]:                # the history's homes and corrections, as the replay builds them
                await engine.generate(t.messages, agent=t.agent, sampling=SamplingParams(max_tokens=1))
            engine.reset_peak()
            before = engine.stats()["memory"]["total_bytes"]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(t.messages, agent=f"{t.agent}#{i}",
                                                          sampling=SamplingParams(max_tokens=n, ignore_eos=True))
                                          for i, t in enumerate(turns)))
            wall = time.perf_counter() - t0
            mem = engine.stats()["memory"]
        finally:
            await engine.aclose()
        return {"method": method.name, "label": method.label, "agents": len(turns),
                "peak_bytes": mem["total_bytes_peak"],
                "peak_over_start_bytes": mem["total_bytes_peak"] - before,
                "tok_s": sum(o.usage.completion_tokens for o in outs) / wall}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(points: Iterable[dict[str, Any]], methods: dict[str, dict[str, Any]]) -> None:
    """Add TTFT and replay-time ratios against prefix/none and peak-memory ratios against kvcomm/prefix
    (the ``methods`` of the same run), in place, to each of ``points``."""
    ratio = _ratio
    for m in points:
        peak = m["memory"]["kv_bytes_total_peak"]
        m["ratios"] = {
            f"ttft_speedup_vs_{base}": ratio(methods[base]["ttft_mean"], m["ttft_mean"])
            for base in ("prefix", "none") if base in methods}
        if "prefix" in methods:
            m["ratios"]["ttft_long_speedup_vs_prefix"] = ratio(methods["prefix"]["ttft_long_mean"], m["ttft_long_mean"])
            m["ratios"]["replay_time_vs_prefix"] = ratio(m["wall_s"], methods["prefix"]["wall_s"])
        m["ratios"].update({
            f"memory_reduction_vs_{base}": ratio(methods[base]["memory"]["kv_bytes_total_peak"], peak)
            for base in ("kvcomm", "prefix") if base in methods})


async def run_bench(cfg: BenchConfig, log: Log = _stderr) -> dict[str, Any]:
    """Run the whole benchmark; returns a JSON-able dict (see ``report`` for the tables and plots)."""
    unknown = set(cfg.methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    with single_threaded_caller(cfg.num_threads) as threads:
        return await _run(cfg, log, threads)


async def _run(cfg: BenchConfig, log: Log, threads: int) -> dict[str, Any]:
    start = time.perf_counter()
    bench = _Bench(cfg, log, threads)
    torch.linalg.svd(torch.randn(64, 64))        # the first SVD of a process loads MKL (seconds)
    result: dict[str, Any] = {"config": {
        "model": cfg.model, "device": cfg.device, "eval_tokens": cfg.eval_tokens, "full_decode": cfg.full_decode,
        "throughput_tokens": cfg.throughput_tokens, "methods": list(cfg.methods),
        "sweep": [m.label for m in cfg.sweep], "torch_threads": threads, "declare": cfg.declare,
        "undeclared": cfg.undeclared},
        "traces": {}}
    for trace in cfg.traces:
        t0 = time.perf_counter()
        exact, served = await run_exact_and_close(bench.engine(METHODS["none"]), trace.scenario, trace.reply_tokens,
                                                  cfg.eval_tokens)
        result["config"].update(served)
        log(f"[bench] {trace.name}: exact pass, {len(exact)} turns, shared history up to "
            f"{max(t.shared_tokens for t in exact)} tokens, longest prompt "
            f"{max(t.prompt_tokens for t in exact)}, {time.perf_counter() - t0:.0f} s")
        entry: dict[str, Any] = {
            "turns": [t.to_dict() for t in exact], "agents": sorted({t.agent for t in exact}),
            "shared_tokens_max": max(t.shared_tokens for t in exact),
            "prompt_tokens_max": max(t.prompt_tokens for t in exact), "methods": {}}
        for name in cfg.methods:
            m = await bench.replay(trace, exact, METHODS[name])
            entry["methods"][name] = m
            f = m["fidelity"]
            log(f"[bench] {trace.name}/{name}: TTFT mean {m['ttft_mean'] * 1e3:.0f} ms, peak "
                f"{m['memory']['kv_bytes_total_peak'] / 2**20:.1f} MiB, first-token KL "
                f"{f.get('first_token_kl_mean', 0):.3g}, {m['wall_s']:.0f} s")
        _ratios(entry["methods"].values(), entry["methods"])
        if cfg.undeclared:
            entry["undeclared"] = {}
            for name in [n for n in ("none", "prefix", "kvcmas", "kvcmas-copy") if n in cfg.methods]:
                m = await bench.replay(trace, exact, METHODS[name], declared=False)
                entry["undeclared"][name] = m
                log(f"[bench] {trace.name}/{name}, undeclared: TTFT mean {m['ttft_mean'] * 1e3:.0f} ms, "
                    f"{m['wall_s']:.0f} s")
            _ratios(entry["undeclared"].values(), entry["undeclared"])
        if cfg.sweep and trace.name == cfg.sweep_trace:
            entry["sweep"] = []
            for method in cfg.sweep:
                m = await bench.replay(trace, exact, method)
                entry["sweep"].append(m)
                log(f"[bench] sweep {method.label}: TTFT mean {m['ttft_mean'] * 1e3:.0f} ms, peak "
                    f"{m['memory']['kv_bytes_total_peak'] / 2**20:.1f} MiB, first-token KL "
                    f"{m['fidelity'].get('first_token_kl_mean', 0):.3g}")
            _ratios(entry["sweep"], entry["methods"])
        if cfg.throughput_tokens and trace is cfg.traces[0]:
            entry["throughput"] = [await bench.throughput(trace, exact, METHODS[n])
                                   for n in ("none", "prefix", "kvcmas", "kvcmas-copy", "kvcmas-idle-copy")
                                   if n in cfg.methods]
        if cfg.throughput_tokens and trace is cfg.traces[0] and "kvcmas-copy" in cfg.methods:
            entry["concurrent_memory"] = [await bench.concurrent_memory(exact, METHODS[n], k)
                                          for k in (1, 4, 8) for n in ("prefix", "kvcmas", "kvcmas-copy")
                                          if n in cfg.methods]
        result["traces"][trace.name] = entry
    result["timing"] = {"total_s": time.perf_counter() - start}
    return result
