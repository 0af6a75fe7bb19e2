"""The peer comparison's table and plot: wall time, later-turn TTFT, decode rates and peak memory by
engine and shared context, with ratios against the best peer measured in the same run."""
from __future__ import annotations

from pathlib import Path
from statistics import median

PEERS = ("llama.cpp", "vllm")


def _by(results: dict) -> dict[tuple[int, str], list[dict]]:
    out: dict[tuple[int, str], list[dict]] = {}
    for r in results["runs"]:
        if "wall_s" in r:
            out.setdefault((r["context"], r["name"]), []).append(r)
    return out


def _med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return median(vals) if vals else None


def _ttft(runs: list[dict]) -> float | None:
    return None if runs and runs[0].get("ttft") == "n/a" else _med(runs, "later_ttft_s")


def markdown(results: dict, command: str) -> str:
    by, cfg = _by(results), results["config"]
    lines = [f"# Multi-agent workflow against the peers", "", f"`{command}`", "",
             f"{cfg['agents']} agents, {cfg['rounds']} rounds, {cfg['reply_tokens']} greedy tokens a turn; "
             f"medians of {cfg['repeats']} interleaved run(s). Ratios: the best peer's figure over this row's "
             "(above 1: this row is faster).", ""]
    if results["missing"]:
        lines += [f"Not installed (scripts/setup_peers.sh): {', '.join(results['missing'])}.", ""]
    failed = [r for r in results["runs"] if "wall_s" not in r]
    for r in failed:
        lines.append(f"- {r['name']} at {r['context']} tokens failed: {r['error']}")
    for ctx in sorted({c for c, _ in by}):
        rows = {name: runs for (c, name), runs in by.items() if c == ctx}
        peer_wall = min((_med(rows[p], "wall_s") for p in PEERS if p in rows), default=None)
        peer_ttft = min((t for p in PEERS if p in rows and (t := _ttft(rows[p])) is not None), default=None)
        shared = rows[next(iter(rows))][0]["shared_tokens"]
        lines += ["", f"## Shared history {shared} tokens", "",
                  "| engine | wall s | runs | later-turn TTFT s | decode tok/s | solo decode tok/s | peak MiB | "
                  "wall vs best peer | TTFT vs best peer |", "|---|---|---|---|---|---|---|---|---|"]
        for name, runs in rows.items():
            wall, ttft, rate = _med(runs, "wall_s"), _ttft(runs), _med(runs, "decode_tok_s")
            solo = _med(runs, "solo_tok_s")
            peak = _med(runs, "peak_rss_bytes")
            lines.append("| " + " | ".join([
                runs[0].get("engine", name), f"{wall:.1f}", " / ".join(f"{r['wall_s']:.1f}" for r in runs),
                f"{ttft:.2f}" if ttft is not None else "n/a", f"{rate:.0f}" if rate else "n/a",
                f"{solo:.0f}" if solo else "n/a", f"{peak / 2**20:.0f}" if peak else "n/a",
                f"{peer_wall / wall:.2f}x" if peer_wall else "-",
                f"{peer_ttft / ttft:.2f}x" if peer_ttft and ttft else "-"]) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path | None:
    """Wall time and later-turn TTFT against shared context, one line per engine (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by = _by(results)
    names = sorted({n for _, n in by})
    if not names:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        pts = sorted((runs[0]["shared_tokens"], _med(runs, "wall_s"), _ttft(runs))
                     for (c, n), runs in by.items() if n == name)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if all(p[2] is not None for p in pts):
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    for ax, title in zip(axes, ("workflow wall time (s)", "later-turn TTFT (s)")):
        ax.set_xlabel("shared history (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
