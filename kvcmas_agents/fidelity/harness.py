"""The fidelity harness: exact pass, per-mode teacher-forced replays, and a recompute_ratio x rank sweep."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

from ..engine import Engine, EngineConfig, KVCMASConfig, ReuseOptions
from .caller_thread import single_threaded_caller
from .conversation import ExactTurn, run_exact_and_close
from .engine_figures import engine_figures
from .replay import ReplayTurn, replay
from .scenarios import Scenario, declare_systems
from .summary import check_targets, pooled, summarize

EXACT_MODES = ("none", "prefix")          # exact by construction: sanity rows, evaluated on fewer tokens
STAT_KEYS = ("reuse", "recompute_ratio", "rank", "reference", "prefetch_ratio", "declared",
             "correction_dtype", "u8_components", "small_row_bits", "u_head_bits", "uncorrected_energy",
             "correction_layers_dropped", "home_views", "home_view_bytes", "corrections", "correction_bytes",
             "kv_bytes_peak", "kv_bytes_total_peak", "template_fallbacks", "realign_refusals", "prefetch",
             "selections_capped", "selections_skipped")
Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class SweepGrid:
    """The recompute_ratio x rank grid, replayed on one scenario with a short continuation."""

    scenario: str = "pipeline"
    ratios: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
    ranks: tuple[int, ...] = (8, 16, 32)
    eval_tokens: int = 8

    def configs(self) -> list[tuple[float, int]]:
        # At ratio 1.0 the engine keeps the exact deviation whatever the rank: one run stands for all.
        return [(r, k) for r in self.ratios for k in (self.ranks if r < 1.0 else self.ranks[:1])]


class _Runner:
    """Builds fresh engines (one per mode and knob setting) and times each replay."""

    def __init__(self, model: str | None, device: str, knobs: ReuseOptions, log: Log, full_decode: bool = True,
                 settings: KVCMASConfig | None = None, threads: int | None = None, declare: bool = True,
                 edges: bool = True):
        self.model, self.device, self.knobs, self.log = model, device, knobs, log
        self.full_decode, self.settings, self.threads = full_decode, settings or KVCMASConfig(), threads
        self.declare, self.edges = declare, edges

    def engine(self, reuse: str, knobs: ReuseOptions | None = None) -> Engine:
        k = knobs or self.knobs
        set_knobs = {f: v for f, v in (("recompute_ratio", k.recompute_ratio), ("rank", k.rank),
                                       ("reference", k.reference)) if v is not None}
        return Engine(EngineConfig(model=self.model, device=self.device, reuse=reuse, num_threads=self.threads,
                                   methods={"kvcmas": replace(self.settings, **set_knobs)}))

    async def replay(self, scenario: Scenario, exact: list[ExactTurn], reuse: str, eval_tokens: int,
                     knobs: ReuseOptions | None = None) -> tuple[list[ReplayTurn], dict[str, Any], float]:
        engine = self.engine(reuse, knobs)
        try:
            if self.edges:
                engine.set_edges(scenario.edges)
            if self.declare:
                declare_systems(engine, scenario)
            t0 = time.perf_counter()
            turns = await replay(engine, exact, eval_tokens, self.full_decode)
            wall = time.perf_counter() - t0
            figures = engine_figures(engine.stats())
            stats = {k: figures[k] for k in STAT_KEYS}
        finally:
            await engine.aclose()
        return turns, stats, wall


async def run_fidelity(scenarios: Sequence[Scenario], modes: Sequence[str] = ("naive", "kvcmas"),
                       knobs: ReuseOptions | None = None, reply_tokens: int = 64, eval_tokens: int = 64,
                       sweep: SweepGrid | None = None, sanity_eval_tokens: int = 8, model: str | None = None,
                       device: str = "cpu", log: Log = _stderr, full_decode: bool = True,
                       settings: KVCMASConfig | None = None, declare: bool = True,
                       edges: bool = True) -> dict[str, Any]:
    """Measure each reuse mode against the exact run of the same prompts; return a JSON-able dict.

    Per scenario: an exact ``reuse="none"`` pass with greedy replies of ``reply_tokens``; then, per mode,
    a fresh engine replays every turn in order, teacher-forced on the first ``eval_tokens`` exact tokens
    (``sanity_eval_tokens`` for the exact-by-construction modes none/prefix); with ``full_decode`` each
    replayed turn decodes its whole exact reply, as an agent does. ``sweep`` replays one of the
    scenarios over a recompute_ratio x rank grid of kvcmas settings. ``settings`` are the engines'
    KVCMAS settings (default: KVCMASConfig()), which ``knobs`` and the sweep override.
    ``declare`` declares the agents' system prompts to each replay's engine first, as the adapters do;
    ``edges`` registers the scenario's edge order (without either, nothing is corrected ahead of time).
    """
    # Scoring runs on this thread; one-threaded, it starts no second OpenMP team beside the engine's.
    with single_threaded_caller() as threads:
        runner = _Runner(model, device, knobs or ReuseOptions(), log, full_decode, settings, threads, declare, edges)
        return await _run(runner, scenarios, modes, reply_tokens, eval_tokens, sweep, sanity_eval_tokens)


async def _run(runner: _Runner, scenarios: Sequence[Scenario], modes: Sequence[str], reply_tokens: int,
               eval_tokens: int, sweep: SweepGrid | None, sanity_eval_tokens: int) -> dict[str, Any]:
    log = runner.log
    start = time.perf_counter()
    result: dict[str, Any] = {"config": {
        "model": runner.model, "device": runner.device, "reply_tokens": reply_tokens, "eval_tokens": eval_tokens,
        "sanity_eval_tokens": sanity_eval_tokens, "modes": list(modes), "knobs": asdict(runner.knobs),
        "full_decode": runner.full_decode, "declare": runner.declare, "edges": runner.edges, "settings": asdict(runner.settings),
        "sweep": asdict(sweep) if sweep else None, "kl_units": "nats", "torch_threads": runner.threads},
        "scenarios": {}}
    for scenario in scenarios:
        t0 = time.perf_counter()
        exact, served = await run_exact_and_close(runner.engine("none"), scenario, reply_tokens, eval_tokens)
        result["config"].update(served)
        exact_s = time.perf_counter() - t0
        log(f"[fidelity] {scenario.name}: exact pass, {len(exact)} turns, shared history "
            f"{exact[0].shared_tokens} -> {exact[-1].shared_tokens} tokens, {exact_s:.0f} s")
        entry: dict[str, Any] = {
            "rounds": scenario.rounds, "groups": [list(g) for g in scenario.groups],
            "edges": [list(e) for e in scenario.edges], "exact_s": exact_s,
            "shared_tokens_first": exact[0].shared_tokens, "shared_tokens_last": exact[-1].shared_tokens,
            "shared_tokens_max": max(t.shared_tokens for t in exact),
            "turns": [t.to_dict() for t in exact], "modes": {}}
        for mode in modes:
            n = min(eval_tokens, sanity_eval_tokens) if mode in EXACT_MODES else eval_tokens
            turns, stats, wall = await runner.replay(scenario, exact, mode, n)
            summary = summarize(turns)
            entry["modes"][mode] = {"eval_tokens": n, "summary": summary, "targets": check_targets(summary),
                                    "stats": stats, "wall_s": wall, "turns": [t.to_dict() for t in turns]}
            log(f"[fidelity] {scenario.name}/{mode}: first-token KL {summary.get('first_token_kl_mean', 0):.4g}, "
                f"TF KL {summary.get('tf_kl_mean', 0):.4g}, agreement {summary.get('agreement_mean', 1):.2f}, "
                f"{wall:.0f} s")
            if sweep and scenario.name == sweep.scenario:
                entry.setdefault("_replays", {})[mode] = (turns, stats)
        if sweep and scenario.name == sweep.scenario:
            result["sweep"] = await _sweep(runner, scenario, exact, sweep, entry.pop("_replays", {}))
        result["scenarios"][scenario.name] = entry
    result["overall"] = {}
    for mode in modes:
        summary = pooled([s["modes"][mode]["summary"] for s in result["scenarios"].values()])
        result["overall"][mode] = {"summary": summary, "targets": check_targets(summary)}
    result["timing"] = {"total_s": time.perf_counter() - start}
    return result


async def _sweep(runner: _Runner, scenario: Scenario, exact: list[ExactTurn], grid: SweepGrid,
                 replays: dict[str, tuple[list[ReplayTurn], dict[str, Any]]]) -> dict[str, Any]:
    """kvcmas over the ratio x rank grid; naive as the floor.

    A setting the main run already replayed is taken from it, scored on the sweep's shorter window.
    With full decode both runs decode the same whole replies, so the replay would be the same; with
    window decode the main run may have decoded more of a reply (a decoded home view needs the whole
    reply), so it is replayed again.
    """
    t0 = time.perf_counter()
    n = grid.eval_tokens
    if not runner.full_decode:
        replays = {}
    naive = replays["naive"][0] if "naive" in replays else (await runner.replay(scenario, exact, "naive", n))[0]
    main = replays.get("kvcmas")
    rows = []
    for ratio, rank in grid.configs():
        if main and (main[1]["recompute_ratio"], main[1]["rank"]) == (ratio, rank):
            (turns, stats), wall, source = main, 0.0, "main run"
        else:
            knobs = ReuseOptions(recompute_ratio=ratio, rank=rank, reference=runner.knobs.reference)
            turns, stats, wall = await runner.replay(scenario, exact, "kvcmas", n, knobs)
            source = "sweep"
        summary = summarize(turns, n)
        rows.append({"recompute_ratio": ratio, "rank": rank if ratio < 1.0 else None, **summary,
                     "correction_bytes": stats["correction_bytes"], "wall_s": wall, "source": source})
        runner.log(f"[fidelity] sweep {scenario.name} ratio {ratio} rank {rank}: first-token KL "
                   f"{summary['first_token_kl_mean']:.4g}, TF KL {summary['tf_kl_mean']:.4g}, {wall:.0f} s")
    return {"scenario": scenario.name, "eval_tokens": n, "ratios": list(grid.ratios), "ranks": list(grid.ranks),
            "naive": summarize(naive, n), "rows": rows, "wall_s": time.perf_counter() - t0}
