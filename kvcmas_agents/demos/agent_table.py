"""The per-agent table the demos and examples print from ``engine.stats()``."""
from __future__ import annotations


def print_agent_stats(stats: dict, width: int = 10) -> None:
    """One line per agent: requests, prompt/cached/reused/recomputed/generated tokens and mean TTFT."""
    e = stats["engine"]
    print(f"\nengine: {e['model']} on {e['device']}, reuse={e['reuse']}, edges={stats['edges']}")
    print(f"{'agent':<{width}}{'requests':>9}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}{'new':>6}"
          f"{'ttft_s':>8}")
    for name, a in stats["agents"].items():
        print(f"{name:<{width}}{int(a['requests']):>9}{int(a['prompt_tokens']):>8}{int(a['cached_tokens']):>8}"
              f"{int(a['reused_tokens']):>8}{int(a['recomputed_tokens']):>11}{int(a['completion_tokens']):>6}"
              f"{a.get('ttft_s_mean', 0.0):>8.2f}")
