"""Write a fidelity result as JSON, a markdown report, and a PNG of KL against recompute_ratio."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KL_FLOOR = 1e-6          # log axes cannot show an exact 0


def _kl(x: float) -> str:
    return f"{x:.2e}" if 0 < x < 1e-3 else f"{x:.4f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def summary_table(result: dict[str, Any]) -> str:
    """Per scenario x mode: means over the later turns (worst turn in parentheses)."""
    lines = ["| scenario | mode | turns | eval tok | first-token KL mean (max) | TF KL mean (max) | "
             "agreement mean (min) | reused mean (min) | not prefilled mean (min) | recomputed | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(name, mode, m["summary"], m["targets"]) for name, s in result["scenarios"].items()
            for mode, m in s["modes"].items()]
    rows += [("**all**", mode, m["summary"], m["targets"]) for mode, m in result.get("overall", {}).items()]
    for name, mode, s, targets in rows:
        if not s.get("turns"):
            continue
        met = "" if mode != "kvcmas" else ("all met" if all(targets.values()) else
                                           "missed: " + ", ".join(k for k, ok in targets.items() if not ok))
        lines.append(
            f"| {name} | {mode} | {s['turns']} | {s['eval_tokens']} | {_kl(s['first_token_kl_mean'])} "
            f"({_kl(s['first_token_kl_max'])}) | {_kl(s['tf_kl_mean'])} ({_kl(s['tf_kl_max'])}) | "
            f"{s['agreement_mean']:.2f} ({s['agreement_min']:.2f}) | {_pct(s['reused_frac_mean'])} "
            f"({_pct(s['reused_frac_min'])}) | {_pct(s['not_prefilled_frac_mean'])} "
            f"({_pct(s['not_prefilled_frac_min'])}) | {_pct(s['recomputed_frac_mean'])} | {met} |")
    return "\n".join(lines)


def turn_table(result: dict[str, Any]) -> str:
    """One row per scenario turn and mode."""
    lines = ["| scenario | turn | round | agent | prompt | shared | mode | cached | reused | recomputed | "
             "first-token KL | TF KL | agreement (exact top-2 logit gap where it broke) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["scenarios"].items():
        for exact in s["turns"]:
            for mode, m in s["modes"].items():
                t = m["turns"][exact["index"]]
                lines.append(
                    f"| {name} | {exact['index']} | {exact['round']} | {exact['agent']} | {t['prompt_tokens']} | "
                    f"{exact['shared_tokens']} | {mode} | {t['cached_tokens']} | {t['reused_tokens']} | "
                    f"{t['recomputed_tokens']} | {_kl(t['first_token_kl'])} | {_kl(t['tf_kl_mean'])} | "
                    f"{t['matched']}/{t['length']}{_gap(t.get('break_gap'))} |")
    return "\n".join(lines)


def _gap(gap: float | None) -> str:
    return "" if gap is None else f" ({gap:.3f})"


def sweep_table(sweep: dict[str, Any]) -> str:
    """kvcmas over recompute_ratio x rank on one scenario, with naive as the floor."""
    n = sweep["naive"]
    lines = [f"Scenario `{sweep['scenario']}`, {sweep['naive']['turns']} later turns, continuation of "
             f"{sweep['eval_tokens']} tokens.", "",
             "| recompute_ratio | rank | first-token KL mean (max) | TF KL mean (max) | agreement | recomputed | "
             "correction bytes |", "|---|---|---|---|---|---|---|",
             f"| naive | - | {_kl(n['first_token_kl_mean'])} ({_kl(n['first_token_kl_max'])}) | "
             f"{_kl(n['tf_kl_mean'])} ({_kl(n['tf_kl_max'])}) | {n['agreement_mean']:.2f} | 0% | 0 |"]
    for r in sweep["rows"]:
        lines.append(
            f"| {r['recompute_ratio']} | {r['rank'] if r['rank'] is not None else 'any'} | "
            f"{_kl(r['first_token_kl_mean'])} ({_kl(r['first_token_kl_max'])}) | {_kl(r['tf_kl_mean'])} "
            f"({_kl(r['tf_kl_max'])}) | {r['agreement_mean']:.2f} | {_pct(r['recomputed_frac_mean'])} | "
            f"{r['correction_bytes']:,} |")
    return "\n".join(lines)


def history_table(result: dict[str, Any]) -> str:
    lines = ["| scenario | turns | shared history, first turn | last turn | exact pass |", "|---|---|---|---|---|"]
    for name, s in result["scenarios"].items():
        lines.append(f"| {name} | {len(s['turns'])} | {s['shared_tokens_first']} | {s['shared_tokens_last']} | "
                     f"{s['exact_s']:.0f} s |")
    return "\n".join(lines)


def timing_table(result: dict[str, Any]) -> str:
    """Wall seconds of each pass (model loads not included), the sweep, and the whole run."""
    modes = list(result["config"]["modes"])
    lines = ["| scenario | exact | " + " | ".join(modes) + " |", "|---" * (len(modes) + 2) + "|"]
    for name, s in result["scenarios"].items():
        lines.append(f"| {name} | {s['exact_s']:.0f} | " + " | ".join(f"{s['modes'][m]['wall_s']:.0f}" for m in modes)
                     + " |")
    sweep = result.get("sweep")
    tail = f"sweep {sweep['wall_s']:.0f} s, " if sweep else ""
    return "\n".join(lines) + f"\n\n{tail}total {result['timing']['total_s']:.0f} s."


def markdown(result: dict[str, Any]) -> str:
    """The whole report: summary, shared-history sizes, sweep, per-turn table."""
    c = result["config"]
    knobs = next((m["stats"] for s in result["scenarios"].values() for name, m in s["modes"].items()
                  if name == "kvcmas"), None)
    knob_line = (f" kvcmas knobs: recompute_ratio {knobs['recompute_ratio']}, rank {knobs['rank']}, reference "
                 f"{knobs['reference']}." if knobs else "")
    parts = [
        "# Fidelity of cross-agent KV reuse",
        f"Model `{c.get('model_name', c['model'])}` on {c.get('device_used', c['device'])}; greedy replies of up "
        f"to {c['reply_tokens']} tokens; KL in nats against an exact `reuse=\"none\"` prefill of the same "
        f"prompt, teacher-forced on the exact greedy continuation. Means are over the later turns (after the "
        f"first turn group), the ones that can reuse other agents' KV. *reused*: prompt tokens taken from other "
        f"agents' views; *not prefilled*: reused plus exact own-context tokens.{knob_line} Total time "
        f"{result['timing']['total_s']:.0f} s.",
        "## Summary", summary_table(result),
        "## Shared history (tokens)", history_table(result)]
    if result.get("sweep"):
        parts += ["## recompute_ratio x rank sweep (kvcmas)", sweep_table(result["sweep"])]
    parts += ["## Time (s)", timing_table(result), "## Per turn", turn_table(result)]
    return "\n\n".join(parts) + "\n"


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """KL vs recompute_ratio: one line per rank (first-token and teacher-forced), naive as a floor."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    full = [r for r in sweep["rows"] if r["rank"] is None]
    for ax, key, title in ((axes[0], "first_token_kl_mean", "first-token KL"),
                           (axes[1], "tf_kl_mean", f"teacher-forced KL ({sweep['eval_tokens']} tokens)")):
        for rank in sweep["ranks"]:
            pts = sorted((r["recompute_ratio"], r[key]) for r in sweep["rows"] if r["rank"] == rank)
            ax.plot([p[0] for p in pts], [max(p[1], KL_FLOOR) for p in pts], marker="o", label=f"kvcmas rank {rank}")
        for r in full:      # ratio 1.0 keeps the exact deviation whatever the rank: one point, not a line
            ax.plot([r["recompute_ratio"]], [max(r[key], KL_FLOOR)], marker="s", color="black", linestyle="",
                    label="kvcmas ratio 1.0 (any rank)")
        ax.axhline(max(sweep["naive"][key], KL_FLOOR), color="red", linestyle="--", label="naive")
        ax.axhline(0.01, color="grey", linestyle=":", label="target 0.01")
        ax.set_yscale("log")
        ax.set_xlabel("recompute_ratio")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean KL vs exact (nats)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"KVCMAS fidelity on '{sweep['scenario']}' (values below {KL_FLOOR:g} drawn at {KL_FLOOR:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write fidelity.json, fidelity.md and (with a sweep) fidelity_sweep.png into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "fidelity.json", "markdown": out / "fidelity.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["markdown"].write_text(markdown(result))
    if result.get("sweep"):
        paths["plot"] = out / "fidelity_sweep.png"
        plot_sweep(result["sweep"], paths["plot"])
    return paths
