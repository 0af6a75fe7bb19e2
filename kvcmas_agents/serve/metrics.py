"""Prometheus text exposition (format 0.0.4) of the gateway's own counters and the engine's stats.

Written by hand: a handful of counters and one histogram do not justify a dependency.
"""
from __future__ import annotations

import threading
from typing import Any, Iterable

from ..engine import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OUTCOMES = ("ok", "client_error", "server_error", "cancelled")
TOKEN_KINDS = ("prompt", "completion", "prefix_cached", "reused", "recomputed", "kept")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine gauges read at scrape time: (metric, help, path in engine.stats()).
ENGINE_GAUGES = (
    ("kvcmas_kv_budget_bytes", "KV cache budget in bytes", ("memory", "kv_budget_bytes")),
    ("kvcmas_kv_bytes", "bytes of KV blocks held (active and cached)", ("memory", "kv_bytes")),
    ("kvcmas_kv_bytes_active", "bytes of KV blocks referenced by requests or home views",
     ("memory", "kv_bytes_active")),
    ("kvcmas_kv_bytes_peak", "peak KV bytes since start", ("memory", "kv_bytes_peak")),
    ("kvcmas_state_bytes", "bytes reuse methods hold outside KV blocks", ("memory", "state_bytes")),
    ("kvcmas_correction_bytes", "bytes of stored KVCMAS corrections", ("reuse", "kvcmas", "correction_bytes")),
    ("kvcmas_corrections", "KVCMAS corrections held", ("reuse", "kvcmas", "corrections")),
    ("kvcmas_home_views", "home views held", ("reuse", "home_views", "count")),
    ("kvcmas_requests_running", "requests running in the engine", ("counters", "num_running")),
    ("kvcmas_requests_waiting", "requests queued in the engine", ("counters", "num_waiting")),
)
ENGINE_COUNTERS = (
    ("kvcmas_engine_requests_total", "requests the engine accepted", ("counters", "requests")),
    ("kvcmas_engine_requests_aborted_total", "engine requests cancelled", ("counters", "aborted")),
    ("kvcmas_engine_requests_failed_total", "engine requests that failed", ("counters", "failed")),
    ("kvcmas_engine_steps_total", "engine forward steps", ("counters", "steps")),
)


def _get(d: Any, path: Iterable[str]) -> float | None:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def engine_stats_list(stats: dict) -> list[dict]:
    """One engine's stats, or each replica's when the backend has several (``{"replicas": [...]}``)."""
    replicas = stats.get("replicas")
    return [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else [stats]


class Metrics:
    """The gateway's counters; ``render`` adds the engine's figures from a stats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = {(ep, o): 0 for ep in ("chat",) for o in OUTCOMES}
        self.tokens = dict.fromkeys(TOKEN_KINDS, 0)
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.reuse_requests = 0          # requests that reused another agent's KV
        self.in_flight = 0

    def outcome(self, outcome: str, endpoint: str = "chat") -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def finished(self, output: RequestOutput) -> None:
        """Account a completed request's tokens and time to first token."""
        u = output.usage
        with self._lock:
            for kind, n in zip(TOKEN_KINDS, (u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                                             u.reused_tokens, u.recomputed_tokens, u.kept_tokens)):
                self.tokens[kind] += n
            self.reuse_requests += int(u.reused_tokens > 0)
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if output.ttft_s <= b), len(TTFT_BUCKETS))
            self.ttft_counts[i] += 1
            self.ttft_sum += output.ttft_s

    def render(self, stats: dict | None) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_fmt(v)}" for labels, v in samples)

        with self._lock:
            family("kvcmas_http_requests_total", "counter", "chat completion requests by outcome",
                   [(f'{{endpoint="{ep}",outcome="{o}"}}', n) for (ep, o), n in sorted(self.requests.items())])
            family("kvcmas_http_requests_in_flight", "gauge", "chat completion requests being served",
                   [("", self.in_flight)])
            family("kvcmas_tokens_total", "counter", "tokens of completed requests by kind (kept = KV served "
                   "as is: prefix-cached plus reused-not-recomputed)",
                   [(f'{{kind="{k}"}}', n) for k, n in self.tokens.items()])
            family("kvcmas_reuse_requests_total", "counter", "completed requests that reused another agent's KV",
                   [("", self.reuse_requests)])
            cumulative, samples = 0, []
            for bound, count in zip((*TTFT_BUCKETS, float("inf")), self.ttft_counts):
                cumulative += count
                samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else _fmt(bound)}"}}', cumulative))
            samples += [("_sum", self.ttft_sum), ("_count", cumulative)]
            lines.append("# HELP kvcmas_ttft_seconds time to first token of completed requests")
            lines.append("# TYPE kvcmas_ttft_seconds histogram")
            lines.extend(f"kvcmas_ttft_seconds{suffix} {_fmt(v)}" for suffix, v in samples)
        if stats is not None:
            engines = engine_stats_list(stats)
            for specs, kind in ((ENGINE_GAUGES, "gauge"), (ENGINE_COUNTERS, "counter")):
                for name, help_, path in specs:
                    values = [v for e in engines if (v := _get(e, path)) is not None]
                    if values:
                        family(name, kind, help_, [("", sum(values))])
        return "\n".join(lines) + "\n"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
