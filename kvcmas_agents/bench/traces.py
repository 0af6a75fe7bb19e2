"""Benchmark traces: the fidelity scenarios, played longer, plus a long-context variant.

A trace is a scenario with a greedy reply length. The ``none`` engine plays it once (the exact pass);
every method then replays the same prompts, so TTFT, memory and fidelity compare turn by turn.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..fidelity.scenarios import CSV, DEBATE, FANOUT, PIPELINE, Scenario


@dataclass(frozen=True)
class Trace:
    name: str
    scenario: Scenario
    reply_tokens: int


def _long_document(target_words: int) -> str:
    """A deterministic, code-like design document of about ``target_words`` words (~1.5 tokens each)."""
    parts, i = [], 0
    while sum(len(p.split()) for p in parts) < target_words:
        parts.append(
            f"Module {i}: the service `svc_{i}` reads orders from queue q{i % 7}, validates field "
            f"`amount_{i}` against limit {100 + 17 * i}, writes audit row {i} to table audit_{i % 5}, and "
            f"retries {1 + i % 3} times on timeout. def handle_{i}(order): return validate_{i}(order) and "
            f"store_{i}(order, retries={1 + i % 3})")
        i += 1
    return "\n".join(parts)


def _with_document(scenario: Scenario, words: int) -> Scenario:
    task = scenario.task + "\n\nReference design document:\n" + _long_document(words)
    return replace(scenario, name=scenario.name + "-long", task=task)


# Quick: one round each, short replies (CI smoke; minutes on 2 CPU cores).
QUICK = (Trace("pipeline", PIPELINE.with_rounds(1), 24), Trace("fanout", FANOUT.with_rounds(1), 24))
# Full: shared history past 2,000 tokens on every trace (measured in the exact pass and reported).
FULL = (Trace("pipeline", PIPELINE.with_rounds(4), 96), Trace("debate", DEBATE.with_rounds(5), 96),
        Trace("fanout", FANOUT.with_rounds(3), 96))
# Long context (GPU): a ~7,700-token design document in the task and one pipeline round, so the shared
# history passes 8,000 tokens inside the default model's 8,192-token window. One round, because each
# turn adds 90-111 tokens (a reply of up to 96 and its frame, measured): over 7 later turns the growth
# varies by about 150 tokens, more than the room between 8,000 shared tokens and the window's end
# (about 125); over 3 it varies by about 60.
LONG = (Trace("pipeline-long", _with_document(PIPELINE, 3030).with_rounds(1), 96),)
TINY = (Trace("csv", CSV, 8),)          # the test suite's smoke trace

PRESETS: dict[str, tuple[Trace, ...]] = {"quick": QUICK, "full": FULL, "long": LONG, "tiny": TINY}


def get_traces(preset: str, names: list[str] | None = None) -> list[Trace]:
    """The traces of a preset, optionally only those named."""
    try:
        traces = list(PRESETS[preset])
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}") from None
    if names:
        unknown = set(names) - {t.name for t in traces}
        if unknown:
            raise ValueError(f"preset {preset!r} has no trace {sorted(unknown)}; it has {[t.name for t in traces]}")
        traces = [t for t in traces if t.name in names]
    return traces
