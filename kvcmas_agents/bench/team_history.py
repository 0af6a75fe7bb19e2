"""One coding team's shared history, the prompts later agents send over it, and the lead agent that
computes it: the common setting of ``kvcmas bench turn-time``, ``tool-loop`` and ``decode-rate``.

A task and six replies of a planner, coder, reviewer and tester (about 1,450 tokens); each later agent
sends its own system prompt, the task, the history and a hand-off, with no edges or ``declare_agent``.
"""
from __future__ import annotations

from ..engine import Engine, SamplingParams
from ..fidelity.scenario_texts import PIPELINE_SYSTEM, PIPELINE_TASK


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

