"""Per-mode summaries over a replay's later turns, and the issue's targets for kvcmas."""
from __future__ import annotations

from statistics import fmean

from .replay import ReplayTurn

# Issue 3's targets for kvcmas at default knobs.
TARGETS = {"first_token_kl_mean": 0.01, "tf_kl_mean": 0.01, "agreement_mean": 0.9, "not_prefilled_frac_min": 0.6}


def later(turns: list[ReplayTurn]) -> list[ReplayTurn]:
    """Turns that can reuse other agents' KV: those after the first turn group, and any turn of that
    group that did (in a concurrent first group, a sibling can compute the shared task first)."""
    return [t for t in turns if t.group > 0 or t.reused_tokens > 0]


def summarize(turns: list[ReplayTurn], eval_tokens: int | None = None) -> dict[str, float]:
    """Means (and worst cases) over the later turns; ``eval_tokens`` truncates the continuation."""
    rows = later(turns)
    if not rows:
        return {"turns": 0}
    m = [t.metrics.truncate(eval_tokens) if eval_tokens else t.metrics for t in rows]
    return {
        "turns": len(rows),
        "eval_tokens": max(x.length for x in m),
        "first_token_kl_mean": fmean(x.first_token_kl for x in m),
        "first_token_kl_max": max(x.first_token_kl for x in m),
        "tf_kl_mean": fmean(x.tf_kl_mean for x in m),
        "tf_kl_max": max(x.tf_kl_mean for x in m),
        "agreement_mean": fmean(x.agreement for x in m),
        "agreement_min": min(x.agreement for x in m),
        "reused_frac_mean": fmean(t.reused_frac for t in rows),
        "reused_frac_min": min(t.reused_frac for t in rows),
        "not_prefilled_frac_mean": fmean(t.not_prefilled_frac for t in rows),
        "not_prefilled_frac_min": min(t.not_prefilled_frac for t in rows),
        "recomputed_frac_mean": fmean(t.recomputed_frac for t in rows),
        "reused_tokens": sum(t.reused_tokens for t in rows),
        "recomputed_tokens": sum(t.recomputed_tokens for t in rows),
        "prompt_tokens": sum(t.prompt_tokens for t in rows),
    }


def check_targets(summary: dict[str, float]) -> dict[str, bool]:
    """Which of the issue's targets a summary meets (KL below, agreement and reuse above)."""
    out = {}
    for key, bound in TARGETS.items():
        if key in summary:
            out[key] = summary[key] <= bound if "kl" in key else summary[key] >= bound
    return out


def pooled(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Turn-weighted means over several scenarios' summaries (mins and maxes stay worst-case)."""
    rows = [s for s in summaries if s.get("turns")]
    if not rows:
        return {"turns": 0}
    n = sum(s["turns"] for s in rows)
    out: dict[str, float] = {"turns": n}
    for key in rows[0]:
        if key == "turns":
            continue
        vals = [s[key] for s in rows]
        if key.endswith("_min"):
            out[key] = min(vals)
        elif key.endswith("_max") or key == "eval_tokens":
            out[key] = max(vals)
        elif key.endswith("_tokens"):
            out[key] = sum(vals)
        else:
            out[key] = sum(s[key] * s["turns"] for s in rows) / n
    return out
