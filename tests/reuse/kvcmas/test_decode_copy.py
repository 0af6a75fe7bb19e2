"""decode_copy="auto": a later agent's corrected view written into its own blocks for its decode."""
from __future__ import annotations

import pytest

from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
from kvcmas_agents.engine import ReuseOptions
from kvcmas_agents.fidelity import CSV_SYSTEM as SYSTEM
from kvcmas_agents.fidelity import CSV_TASK as TASK
from kvcmas_agents.fidelity import kl
from kvcmas_agents.reuse.kvcmas.config import DECODE_COPY_MIN

DECODE = SamplingParams(max_tokens=DECODE_COPY_MIN + 8, ignore_eos=True, return_logits=True)


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM[agent]}] + history


async def later_turn(copy: str, sampling: SamplingParams = DECODE, room: bool = True):
    """The planner answers the task; the coder then reuses it, with the planner's reply as a message.
    ``room=False``: the KV budget has no blocks to spare for a copy."""
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, decode_copy=copy)}))
    if not room:
        eng.methods["kvcmas"].ctx.own_holes = lambda req: False
    try:
        history = [{"role": "user", "content": TASK}]
        first = await eng.generate(prompt("planner", history), agent="planner", sampling=SamplingParams(max_tokens=32))
        history.append({"role": "user", "content": f"[planner] {first.text}"})
        out = await eng.generate(prompt("coder", history), agent="coder", sampling=sampling)
        assert len(eng.methods["kvcmas"].states) == 0          # each request's state went with it
        return out, eng.stats(), history
    finally:
        await eng.aclose()


async def test_a_copied_view_decodes_as_the_read_through_view_and_is_freed():
    (read, st_read, _), (copied, st_copy, _) = await later_turn("off"), await later_turn("auto")
    assert st_read["reuse"]["kvcmas"]["decode_copies"] == 0
    assert st_copy["reuse"]["kvcmas"]["decode_copies"] == 1 and st_copy["reuse"]["kvcmas"]["decode_copy_blocks"] > 0
    assert copied.usage.reused_tokens == read.usage.reused_tokens > 0
    # The same view, read through or copied: the same greedy tokens, logits equal to rounding.
    assert copied.token_ids == read.token_ids
    assert max(kl(a, b) for a, b in zip(read.logits, copied.logits)) < 1e-6
    # The copy lived only as long as the request: blocks back to what the read-through run holds.
    assert st_copy["memory"]["blocks_in_use"] == st_read["memory"]["blocks_in_use"]
    assert st_copy["memory"]["kv_bytes_peak"] > st_read["memory"]["kv_bytes_peak"]
    assert st_copy["counters"]["num_running"] == 0


async def test_short_replies_and_a_full_budget_keep_the_read_through_view():
    short = SamplingParams(max_tokens=DECODE_COPY_MIN)          # fewer decode steps than the copy pays for
    _, st, _ = await later_turn("auto", short)
    assert st["reuse"]["kvcmas"]["decode_copies"] == 0
    # No blocks to spare in the budget: no copy, the same answer read through.
    out, st, _ = await later_turn("auto", room=False)
    ref, _, _ = await later_turn("off")
    assert st["reuse"]["kvcmas"]["decode_copies"] == 0 and out.token_ids == ref.token_ids


def test_decode_copy_is_checked():
    with pytest.raises(ValueError, match="decode_copy"):
        KVCMASConfig(decode_copy="always")


async def test_a_correcting_request_says_where_its_ttft_went():
    out, _, _ = await later_turn("off", SamplingParams(max_tokens=1))
    t = out.timings
    assert {"queue", "plan", "select", "recompute", "compress", "correct", "forward"} <= set(t)
    assert t["correct"] >= t["select"] + t["recompute"] + t["compress"] - 1e-6
    assert all(v >= 0 for v in t.values())
    assert t["queue"] + t["correct"] + t["forward"] <= out.ttft_s + 1e-3
    async with Engine(EngineConfig(reuse="prefix")) as eng:
        plain = await eng.generate(prompt("coder", [{"role": "user", "content": TASK}]), agent="c",
                                   sampling=SamplingParams(max_tokens=1), reuse_options=ReuseOptions(reuse="prefix"))
    assert "forward" in plain.timings and "correct" not in plain.timings


async def test_a_read_through_decode_keeps_its_unpacked_codes_as_state_only_while_it_runs():
    """Decoding over the view (no copy) keeps the corrections' unpacked codes on the request's view: they
    are counted in the engine's state bytes while it decodes, and dropped when it ends."""
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    try:
        history = [{"role": "user", "content": TASK}]
        first = await eng.generate(prompt("planner", history), agent="planner", sampling=SamplingParams(max_tokens=32))
        history.append({"role": "user", "content": f"[planner] {first.text}"})
        during, seen = None, 0
        async for delta in eng.stream(prompt("coder", history), agent="coder", sampling=DECODE):
            seen += len(delta.token_ids)
            if during is None and seen >= 4 and delta.output is None:      # a few decode steps in
                during = eng.stats()
        after = eng.stats()
    finally:
        await eng.aclose()
    kept = during["reuse"]["kvcmas"]["kept_code_bytes"]
    assert kept > 0 and delta.output.usage.reused_tokens > 0
    assert during["memory"]["state_bytes"] == during["reuse"]["kvcmas"]["correction_bytes"] + kept
    assert after["reuse"]["kvcmas"]["kept_code_bytes"] == 0
    assert after["memory"]["state_bytes"] == after["reuse"]["kvcmas"]["correction_bytes"]
