"""The engine's counters, shared by the caller threads and the worker, and the grouped ``stats()``."""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

COUNTERS = ("requests", "declared", "declare_failed", "completed", "failed", "aborted", "prompt_tokens",
            "completion_tokens", "cached_tokens", "steps", "max_batch_seqs", "template_fallbacks",
            "realign_refusals", "reuse_fallbacks", "idle_work_failed")
AGENT_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "reused_tokens", "recomputed_tokens")


class Counters:
    """Thread-safe request counters and per-agent usage."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._agents: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self._counts[key] += n

    def raise_to(self, key: str, value: int) -> None:
        with self.lock:
            self._counts[key] = max(self._counts[key], value)

    def record(self, agent: str, usage: Any, ttft_s: float) -> None:
        """A completed request's usage."""
        with self.lock:
            c = self._counts
            c["completed"] += 1
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                c[k] += getattr(usage, k)
            a = self._agents[agent]
            a["requests"] += 1
            a["ttft_s_total"] += ttft_s
            for k in AGENT_KEYS:
                a[k] += getattr(usage, k)

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
        with self.lock:
            counts = {k: self._counts.get(k, 0) for k in COUNTERS}
            agents = {a: dict(v) for a, v in self._agents.items()}
        for a in agents.values():
            if a.get("requests"):
                a["ttft_s_mean"] = a.get("ttft_s_total", 0.0) / a["requests"]
        return counts, agents
