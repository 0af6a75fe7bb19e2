"""Turn-time TTFT of later agents over one shared history, with nothing declared: where the time goes.

A lead agent computes a shared history (a task and the replies of a coding team, about 1,450 tokens);
then three more agents, each with its own system prompt and no edges or ``declare_agent``, read the same
history plus a hand-off, one after another, and produce their first token. ``prefix`` prefills each
later agent's whole prompt (it has no earlier prompt of its own); ``kvcmas`` reuses the lead's view and
corrects it at turn time. Rounds alternate the modes in one process, so the ratios are side by side.

Prints one JSON object: per mode, each later agent's TTFT (median over rounds), its phases
(``RequestOutput.timings``: plan, select, recompute, compress, forward, ...), tokens reused and
recomputed, and the first-token KL against ``prefix`` (exact).

    python -m benchmarks.turn_time [--rounds 3] [--ratio 0.5 --ratio 0.2 ...] [--no-newest]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from kvcmas_agents import KVCMASConfig
from kvcmas_agents.engine import Engine, EngineConfig, SamplingParams
from kvcmas_agents.fidelity import kl
from kvcmas_agents.fidelity.scenario_texts import PIPELINE_SYSTEM, PIPELINE_TASK

FIRST = SamplingParams(max_tokens=1, return_logits=True)
LEAD = "planner"

PLAN = """\
[planner] PLAN: I assume the intervals are tuples of two integers and that the caller may pass them in any order.
1. Validate every interval first: if any start is greater than its end, raise ValueError naming the interval.
2. Copy the input and sort the copy by start, so the caller's list is never modified.
3. Walk the sorted intervals and keep a result list. If the next interval starts at or before the last end
   plus one, extend the last interval to the larger end; otherwise append it as a new interval.
4. Return the result list. An empty input returns an empty list."""

CODE = '''\
[coder] ```python
from typing import List, Tuple

Interval = Tuple[int, int]


def merge_intervals(intervals: List[Interval]) -> List[Interval]:
    """Merge overlapping or touching closed integer intervals.

    Args:
        intervals: Closed intervals (start, end) in any order.

    Returns:
        The smallest list of intervals covering the same integers, sorted by start.

    Raises:
        ValueError: If an interval has start greater than end.
    """
    for start, end in intervals:
        if start > end:
            raise ValueError(f"invalid interval ({start}, {end}): start is greater than end")
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged: List[Interval] = []
    for start, end in ordered:
        if merged and start <= merged[-1][1] + 1:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged
```'''

REVIEW = """\
[reviewer] [MEDIUM] The function does not check that each item is a pair of integers: a tuple of three values
or a pair of floats fails later with an unhelpful error, or silently merges floats as if they were integers.
[LOW] The error message repeats the interval but not its index in the input, which makes large inputs hard to
debug. [LOW] The docstring does not say that touching intervals such as (1, 2) and (3, 4) are merged, which is
the one rule a reader is most likely to get wrong. [MEDIUM] Sorting by start alone is fine for correctness, but
the code relies on tuples; a list of lists would be accepted and returned as tuples, changing the type the caller
passed in. Verdict: request changes."""

TESTS = """\
[tester] Empty input: merge_intervals([]) returns [] and does not raise.
Single point: merge_intervals([(1, 1)]) returns [(1, 1)].
Touching intervals: merge_intervals([(1, 2), (3, 4)]) returns [(1, 4)] because together they cover 1 to 4.
Nested intervals: merge_intervals([(1, 10), (2, 3), (4, 5)]) returns [(1, 10)].
Duplicates: merge_intervals([(2, 4), (2, 4)]) returns [(2, 4)].
Unsorted input: merge_intervals([(5, 7), (1, 3), (2, 4)]) returns [(1, 4), (5, 7)] and leaves the input list
unchanged, in the same order, afterwards.
Invalid interval: merge_intervals([(3, 1)]) raises ValueError that names the interval (3, 1).
Negative numbers: merge_intervals([(-5, -3), (-2, 0)]) returns [(-5, 0)] because -3 and -2 touch.
Large gaps: merge_intervals([(1, 2), (100, 200)]) returns both intervals unchanged, in order."""

PLAN2 = """\
[planner] PLAN: The review and the tests agree on the behaviour; the changes are about input checks and clarity.
1. Check that every item is a pair of integers, and raise TypeError naming the index of the first bad item.
2. Keep the ValueError for a start greater than its end, and add the item's index to the message.
3. State in the docstring that touching intervals are merged, with the example (1, 2) and (3, 4).
4. Keep returning tuples, and say so in the docstring, so callers know the output type.
5. Keep the sorted copy so that the input is never modified, and add the tester's cases as doctests."""

CODE2 = '''\
[coder] ```python
from typing import List, Sequence, Tuple

Interval = Tuple[int, int]


def merge_intervals(intervals: Sequence[Sequence[int]]) -> List[Interval]:
    """Merge overlapping or touching closed integer intervals.

    Touching intervals are merged too: (1, 2) and (3, 4) become (1, 4), because together they
    cover every integer from 1 to 4. The input is never modified; the result holds tuples.

    >>> merge_intervals([(5, 7), (1, 3), (2, 4)])
    [(1, 4), (5, 7)]
    >>> merge_intervals([])
    []
    """
    checked: List[Interval] = []
    for index, item in enumerate(intervals):
        if len(item) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            raise TypeError(f"item {index} must be a pair of integers, got {item!r}")
        start, end = item
        if start > end:
            raise ValueError(f"item {index} ({start}, {end}) has start greater than end")
        checked.append((start, end))
    checked.sort()
    merged: List[Interval] = []
    for start, end in checked:
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
```'''

HISTORY = [PLAN, CODE, REVIEW, TESTS, PLAN2, CODE2]
LATER = {"reviewer": "reviewer: in two or three sentences, say whether the coder's new code fixes the problems.",
         "tester": "tester: which edge cases does the coder's new function still miss? Name three, one sentence each.",
         "coder": "coder: write the updated Python function. Reply with only a ```python code block."}


def prompt(agent: str, handoff: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": PIPELINE_SYSTEM[agent]}, {"role": "user", "content": PIPELINE_TASK}]
    msgs += [{"role": "user", "content": text} for text in HISTORY]
    if handoff is not None:
        msgs.append({"role": "user", "content": handoff})
    return msgs


async def lead_history(engine: Engine) -> None:
    """The lead agent computes the shared history (its first token), so later agents can reuse it."""
    await engine.generate(prompt(LEAD, "planner: summarize the plan in one sentence."), agent=LEAD, sampling=FIRST)


async def one_round(mode: str, kvcmas: KVCMASConfig) -> dict[str, dict]:
    """A fresh engine: the lead computes the history, then each later agent's first token."""
    engine = Engine(EngineConfig(reuse=mode, kvcmas=kvcmas))
    try:
        await lead_history(engine)
        outs = {}
        for agent, handoff in LATER.items():
            out = await engine.generate(prompt(agent, handoff), agent=agent, sampling=FIRST)
            outs[agent] = {"ttft_s": out.ttft_s, "timings": out.timings, "prompt_tokens": out.usage.prompt_tokens,
                           "reused_tokens": out.usage.reused_tokens, "recomputed_tokens": out.usage.recomputed_tokens,
                           "logits": out.logits[0]}
        return outs
    finally:
        await engine.aclose()


async def run(rounds: int, variants: dict[str, tuple[str, KVCMASConfig]]) -> dict:
    """Each variant (name -> (reuse mode, KVCMAS settings); one must be "prefix", the exact reference)
    over ``rounds`` fresh engines, rounds interleaved."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (mode, cfg) in variants.items():
            runs[name].append(await one_round(mode, cfg))
    exact = runs["prefix"][0]
    result: dict = {"rounds": rounds, "modes": {}}
    for name, rs in runs.items():
        agents = {}
        for agent in LATER:
            first = rs[0][agent]
            ttft = statistics.median(r[agent]["ttft_s"] for r in rs)
            phases = {k: statistics.median(r[agent]["timings"].get(k, 0.0) for r in rs)
                      for k in sorted({k for r in rs for k in r[agent]["timings"]})}
            agents[agent] = {"ttft_s": ttft, "phases": phases, "prompt_tokens": first["prompt_tokens"],
                             "reused_tokens": first["reused_tokens"], "recomputed_tokens": first["recomputed_tokens"],
                             "first_token_kl": kl(exact[agent]["logits"], first["logits"]),
                             "same_top1": bool(exact[agent]["logits"].argmax() == first["logits"].argmax())}
        mean = statistics.mean(a["ttft_s"] for a in agents.values())
        result["modes"][name] = {"agents": agents, "ttft_mean_s": mean}
    # the shared history, as the reusing modes saw it (prefix reuses nothing across agents)
    result["history_tokens"] = max(a["reused_tokens"] for m in result["modes"].values() for a in m["agents"].values())
    base = result["modes"]["prefix"]["ttft_mean_s"]
    for m in result["modes"].values():
        m["speedup_vs_prefix"] = base / m["ttft_mean_s"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ratio", type=float, action="append",
                   help="kvcmas recompute_ratio(s) to run, each a variant (default: the engine's default only)")
    p.add_argument("--no-newest", action="store_true", help="also run kvcmas without recompute_newest")
    args = p.parse_args()
    variants: dict[str, tuple[str, KVCMASConfig]] = {"prefix": ("prefix", KVCMASConfig())}
    for r in args.ratio or [None]:
        name, knobs = ("kvcmas", {}) if r is None else (f"kvcmas@{r}", {"recompute_ratio": r})
        variants[name] = ("kvcmas", KVCMASConfig(**knobs))
        if args.no_newest:
            variants[f"{name}-no-newest"] = ("kvcmas", KVCMASConfig(recompute_newest=False, **knobs))
    result = asyncio.run(run(args.rounds, variants))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
