"""Where kvcmas's correction bytes go on a bench trace, and what other storages of them would lose.

    python -m benchmarks.storage_probe [--preset full] [--trace pipeline] [--dtype float32] [--out DIR]

Plays the trace's exact pass, then replays it through a kvcmas engine at its defaults as ``kvcmas bench``
does (agents declared, whole replies decoded), capturing every deviation the engine compresses (by
wrapping ``reuse.kvcmas.correction``'s ``compress`` and ``compress_joint``). Reports, as JSON and markdown:

- the correction states held at the end, by agent, storage (factored, or rows) and whether a later
  real request read them (those not read were made for turns the trace does not have);
- on the small corrections (those kept as rows): the share of the deviation's energy that rows in 8,
  6 and 4 bits lose, against their own rank-r SVD, and against projecting them on the basis of
  their agent's latest factored correction (could requests share bases?);
- on the factored corrections: how many components a rank allocated over layers and KV heads by
  energy would need to lose as much as rank r everywhere;
- each layer's share of the deviations' energy (keys and values), and from which layer the engine's
  ``uncorrected_energy`` rule (``deviation.faint_layers``) stores each request's corrections.
Energies are over the storable layers (from ``UNCORRECTED_LAYERS`` on). A dev probe: figures, not speed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from kvcmas_agents.bench.methods import METHODS
from kvcmas_agents.bench.traces import get_traces
from kvcmas_agents.engine import Engine
from kvcmas_agents.fidelity.caller_thread import single_threaded_caller
from kvcmas_agents.fidelity.conversation import run_exact_and_close
from kvcmas_agents.fidelity.replay import replay
from kvcmas_agents.fidelity.scenarios import declare_systems
from kvcmas_agents.reuse.kvcmas import correction
from kvcmas_agents.reuse.storage.codec import Format, compress, rows_are_smaller
from kvcmas_agents.reuse.storage.delta import unique_nbytes
from kvcmas_agents.reuse.storage.deviation import faint_layers, layer_energy

ROW_BITS = (8, 6, 4)
UNCORRECTED = correction.UNCORRECTED_LAYERS


@contextmanager
def capture(engine: Engine) -> Iterator[list[dict[str, Any]]]:
    """Record each deviation the engine's corrector compresses: agent, request, rows, dk/dv (fp32, CPU)."""
    calls: list[dict[str, Any]] = []
    current: dict[str, str] = {}
    corrector = engine.methods["kvcmas"].corrector
    recompute, single, joint = corrector._recompute, correction.compress, correction.compress_joint

    def record(dk: torch.Tensor, dv: torch.Tensor) -> None:
        calls.append({**current, "rows": dk.shape[2], "dk": dk.float().cpu(), "dv": dv.float().cpu()})

    def on_recompute(view, *args, **kwargs):
        current.update(agent=view.req.agent, request=view.req.request_id)
        return recompute(view, *args, **kwargs)

    def on_single(dk, dv, *args, **kwargs):
        record(dk, dv)
        return single(dk, dv, *args, **kwargs)

    def on_joint(dks, dvs, *args, **kwargs):
        record(torch.cat(dks, 2), torch.cat(dvs, 2))
        return joint(dks, dvs, *args, **kwargs)

    corrector._recompute, correction.compress, correction.compress_joint = on_recompute, on_single, on_joint
    try:
        yield calls
    finally:
        del corrector._recompute
        correction.compress, correction.compress_joint = single, joint


def captured_energy(d: torch.Tensor, rank: int, reduce: bool = True) -> torch.Tensor:
    """Share of squared Frobenius norm that the top ``rank`` singular values of d [..., R, D] hold.

    ``reduce=True`` gives one fp32 scalar over all matrices (energy-weighted); otherwise one value per
    matrix. A matrix with no energy counts as fully captured.
    """
    s2 = torch.linalg.svdvals(d.float()).pow(2)
    kept, total = s2[..., :rank].sum(-1), s2.sum(-1)
    if reduce:
        kept, total = kept.sum(), total.sum()
    return torch.where(total > 0, kept / total.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(total))


def rows_loss(d: torch.Tensor, bits: int, channels: bool) -> float:
    """Share of d's [L, KVH, R, D] energy lost as ``bits``-bit rows, stored as the engine stores them
    (``compress`` with key_bits/value_bits; keys get channel scales first)."""
    state = compress(d, d, torch.arange(d.shape[2]), 0, Format(key_bits=bits, value_bits=bits))
    back = (state.key_coeffs() if channels else state.value_coeffs()).at()
    return float((back - d).pow(2).sum() / d.pow(2).sum())


def svd_basis(d: torch.Tensor, rank: int) -> torch.Tensor:
    """Leading right singular vectors [.., r, D] of each matrix of d [.., R, D]."""
    return torch.linalg.svd(d.double(), full_matrices=False)[2][..., :rank, :]


def projection_loss(d: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of d's energy outside the row space of ``basis`` (same leading dims)."""
    x = d.double()
    return float((x - x @ basis.transpose(-1, -2) @ basis).pow(2).sum() / x.pow(2).sum())


def allocation(spectra: list[torch.Tensor], rank: int) -> tuple[int, int]:
    """(components at rank r in every matrix, fewest components, largest first over all of a request's
    matrices, that lose no more energy) summed over the requests; spectra are singular values [.., n]."""
    uniform = needed = 0
    for s in spectra:
        s2 = s.double().pow(2)
        kept = s2[..., :rank].sum()
        cum = s2.flatten().sort(descending=True).values.cumsum(0)
        uniform += s2[..., 0].numel() * min(rank, s2.shape[-1])
        needed += int((cum < kept * (1 - 1e-9)).sum()) + 1
    return uniform, needed


def layer_shares(calls: list[dict[str, Any]], share: float) -> dict[str, Any]:
    """Each layer's share of the captured deviations' squared norm (keys, values), and how many requests
    ``faint_layers`` at ``share`` has start their corrections at each layer (layer 0 never stored)."""
    out: dict[str, Any] = {}
    for s in ("dk", "dv"):
        e = layer_energy([c[s] for c in calls])
        out[s] = (e / e.sum()).tolist()
    starts = defaultdict(int)
    for c in calls:
        starts[max(UNCORRECTED, faint_layers([c["dk"]], [c["dv"]], share))] += 1
    out["uncorrected_energy"], out["first_layers"] = share, dict(sorted(starts.items()))
    return out


def analyse(calls: list[dict[str, Any]], rank: int, first: int, faint: float = 0.0) -> dict[str, Any]:
    """The storage figures of captured deviations (storable layers from ``first`` on; ``faint``: the
    engine's uncorrected_energy)."""
    stored = [{**c, "dk": c["dk"][first:], "dv": c["dv"][first:]} for c in calls]
    for c in stored:
        c["small"] = rows_are_smaller(c["rows"], c["dk"].shape[-1], rank, channels=True)
    small, large = [c for c in stored if c["small"]], [c for c in stored if not c["small"]]
    out: dict[str, Any] = {"small_requests": len(small), "small_rows": sum(c["rows"] for c in small),
                           "factored_requests": len(large), "factored_rows": sum(c["rows"] for c in large)}

    def pooled(fn, cs, side):
        lost = sum(fn(c[side]) * c[side].pow(2).sum().item() for c in cs)
        return lost / max(sum(c[side].pow(2).sum().item() for c in cs), 1e-30)

    if small:
        out["small_lost"] = {f"rows{b}": {s: pooled(lambda d, b=b, s=s: rows_loss(d, b, s == "dk"), small, s)
                                          for s in ("dk", "dv")} for b in ROW_BITS}
        out["small_lost"][f"svd{rank}"] = {s: pooled(lambda d: 1 - captured_energy(d, rank).item(), small, s)
                                           for s in ("dk", "dv")}
        latest: dict[str, dict[str, torch.Tensor]] = {}
        shared = defaultdict(list)
        for c in stored:                         # in call order: a small one meets its agent's latest basis
            if c["small"]:
                if c["agent"] in latest:
                    for s in ("dk", "dv"):
                        shared[s].append((projection_loss(c[s], latest[c["agent"]][s]), c[s].pow(2).sum().item()))
            else:
                latest[c["agent"]] = {s: svd_basis(c[s], rank) for s in ("dk", "dv")}
        if shared["dk"]:
            out["small_lost"]["agent_basis"] = {s: sum(x * w for x, w in v) / sum(w for _, w in v)
                                                for s, v in shared.items()}
            out["small_lost"]["agent_basis_requests"] = len(shared["dk"])
    if calls:
        out["layers"] = layer_shares(calls, faint)
    for s in ("dk", "dv"):
        if large:
            uniform, needed = allocation([torch.linalg.svdvals(c[s].double()) for c in large], rank)
            out[f"allocation_{s}"] = {"uniform": uniform, "by_energy": needed, "ratio": needed / uniform}
    return out


def held(engine: Engine, read: set) -> list[dict[str, Any]]:
    """The correction states held, one row per (agent, segment, position, context)."""
    out = []
    for key, corr in engine.segments.held_corrections().items():
        own = corr.own
        out.append({"agent": corr.agent, "rows": own.num_rows,
                    "bytes": own.nbytes - unique_nbytes([own], bases_only=True),
                    "storage": "rows" if own.k.b is None else "factored", "read": key in read})
    return out


def summarize_held(items: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"segments": 0, "rows": 0, "mib": 0.0})
    for i in items:
        for name in (f"{i['storage']}, {'read' if i['read'] else 'not read'}", "all"):
            g = groups[name]
            g["segments"] += 1
            g["rows"] += i["rows"]
            g["mib"] += i["bytes"] / 2**20
    return dict(groups)


async def probe(preset: str, trace_name: str, dtype: str | None) -> dict[str, Any]:
    trace = get_traces(preset, [trace_name])[0]
    with single_threaded_caller() as threads:
        extra = {"num_threads": threads, **({"dtype": dtype} if dtype else {})}
        exact, _ = await run_exact_and_close(Engine(METHODS["none"].config(None, "cpu", **extra)), trace.scenario,
                                             trace.reply_tokens, 16)
        engine = Engine(METHODS["kvcmas"].config(None, "cpu", **extra))
        try:
            engine.set_edges(trace.scenario.edges)
            declare_systems(engine, trace.scenario)
            read: set = set()
            lookup = engine.segments.correction

            def reading(agent, tokens, start, context):
                found = lookup(agent, tokens, start, context)
                if found is not None:
                    read.add((agent, tokens, start, context))
                return found

            engine.segments.correction = reading
            with capture(engine) as calls:
                await replay(engine, exact, 16, True)
            stats = engine.stats()
            items = held(engine, read)
        finally:
            await engine.aclose()
        cfg, spec = engine.config.kvcmas, engine.config.kvcmas.storage
        kvcmas = stats["reuse"]["kvcmas"]
        return {"preset": preset, "trace": trace_name, "dtype": stats["engine"]["dtype"], "rank": cfg.rank,
                "small_row_bits": spec.small_row_bits, "u_head_bits": spec.u_head_bits,
                "uncorrected_energy": spec.uncorrected_energy, "correction_mib": kvcmas["correction_bytes"] / 2**20,
                "basis_mib": kvcmas["correction_basis_bytes"] / 2**20, "held": summarize_held(items),
                "deviations": analyse(calls, cfg.rank, UNCORRECTED, spec.uncorrected_energy)}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# storage probe: {r['trace']} ({r['preset']}, {r['dtype']}), rank {r['rank']}, "
             f"small rows in {r['small_row_bits']} bits, U's leading components in {r['u_head_bits']} bits, "
             f"uncorrected_energy {r['uncorrected_energy']}", "",
             f"Corrections held at the end: {r['correction_mib']:.1f} MiB (bases {r['basis_mib']:.1f}).", "",
             "| states | segments | rows | MiB without bases |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['segments']} | {v['rows']} | {v['mib']:.1f} |" for k, v in sorted(r["held"].items())]
    d = r["deviations"]
    lines += ["", f"Small corrections: {d['small_requests']} requests, {d['small_rows']} rows; factored: "
              f"{d['factored_requests']} requests, {d['factored_rows']} rows.", ""]
    if "small_lost" in d:
        lines += ["| small corrections stored as | key energy lost | value energy lost |", "|---|---|---|"]
        lines += [f"| {k} | {v['dk']:.4%} | {v['dv']:.4%} |" for k, v in d["small_lost"].items() if isinstance(v, dict)]
    if "layers" in d:
        e = d["layers"]
        lines += ["", "| layer | key energy | value energy | keys up to it | values up to it |",
                  "|---|---|---|---|---|"]
        ck = cv = 0.0
        for i, (k, v) in enumerate(zip(e["dk"], e["dv"])):
            ck, cv = ck + k, cv + v
            lines.append(f"| {i} | {k:.3%} | {v:.3%} | {ck:.3%} | {cv:.3%} |")
        lines.append(f"\nFirst stored layer per request at uncorrected_energy={e['uncorrected_energy']}: "
                     + ", ".join(f"{k}: {v}" for k, v in e["first_layers"].items()) + ".")
    for s, name in (("dk", "keys"), ("dv", "values")):
        a = d.get(f"allocation_{s}")
        if a:
            lines.append(f"\nFactored {name}: rank {r['rank']} everywhere is {a['uniform']} components; allocated "
                         f"by energy, {a['by_energy']} lose as much ({a['ratio']:.2f}x).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="full", choices=("full", "quick", "tiny", "long"))
    ap.add_argument("--trace", default="pipeline")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="benchmarks/results/storage_probe")
    args = ap.parse_args(argv)
    result = asyncio.run(probe(args.preset, args.trace, args.dtype))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "storage_probe.json").write_text(json.dumps(result, indent=1))
    (out / "storage_probe.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
