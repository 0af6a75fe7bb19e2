"""Scheduler: admission against the block promise, step planning, prefix indexing and release.

Runs the real Scheduler over a tiny KVStore with real Request objects; the "model" is simulated by
committing each planned item and appending a fake sampled token, as the engine does.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.cache.prefix_cache import PrefixCache, PrefixIndex
from kvcmas_agents.chat.template import RenderedPrompt, Segment
from kvcmas_agents.engine.blocks import RequestBlocks
from kvcmas_agents.engine.budget import KVBudget
from kvcmas_agents.engine.config import EngineConfig, SamplingParams
from kvcmas_agents.engine.request import Request
from kvcmas_agents.engine.scheduler import Scheduler, StepItem
from kvcmas_agents.engine.stats import Counters
from kvcmas_agents.errors import EngineError
from kvcmas_agents.reuse import ReuseContext, method_class
from kvcmas_agents.reuse.base import ReuseMethod
from kvcmas_agents.reuse.plan import ReusePlan

BS = 4
_ids = itertools.count()


def make_sched(num_blocks: int = 16, reuse: str = "prefix", max_batch_tokens: int = 64,
               max_num_seqs: int = 8) -> Scheduler:
    block_bytes = 2 * 1 * BS * 1 * 2 * 4
    index = PrefixIndex()
    store = KVStore(1, 1, 2, BS, num_blocks * block_bytes, torch.device("cpu"), torch.float32, index.forget)
    assert store.num_blocks == num_blocks
    cfg = EngineConfig(reuse=reuse, block_size=BS, max_batch_tokens=max_batch_tokens,
                       max_num_seqs=max_num_seqs, kv_budget_bytes=num_blocks * block_bytes)
    prefix = PrefixCache(store, index)
    blocks = RequestBlocks(store, prefix)
    # The exact modes need no model: only the store and the prefix cache.
    ctx = ReuseContext(None, store, prefix, None, None, "gather", lambda a: [], lambda a: [], None,
                       blocks.apply_plan, blocks.reserve, blocks.free, blocks.own_holes)
    methods = {name: method_class(name)(ctx) for name in ("none", "prefix")}
    methods[None] = methods[cfg.reuse]        # requests never added (side requests) keep unresolved options
    budget = KVBudget(store, methods, lambda: False)
    return Scheduler(cfg, blocks, methods, budget, Counters())


def make_req(tokens: list[int], max_new: int = 4, agent: str = "a", prefix_stable: bool = True) -> Request:
    prompt = RenderedPrompt(token_ids=list(tokens), segments=[Segment(0, len(tokens), "message", "user", 0)],
                            prefix_stable=prefix_stable, text="")
    return Request(request_id=f"r{next(_ids)}", agent=agent, prompt=prompt, sampling=SamplingParams(max_tokens=max_new),
                   max_new_tokens=max_new, detok=None, sink=lambda e: None)


def check_invariants(s: Scheduler) -> None:
    st = s.store.stats()
    assert s.blocks.promised == sum(r.reserved_blocks for r in s.running)
    assert s.blocks.promised <= s.store.num_available
    assert st.blocks_active == len({b for r in s.running for b in r.blocks})
    for r in s.running:
        assert len(r.blocks) + r.reserved_blocks == s.blocks.blocks_for(r.max_total_tokens)


def step(s: Scheduler, finish_at_max: bool = True) -> list[StepItem]:
    """One engine step without a model: plan, commit, sample a fake token, retire finished requests."""
    items = s.schedule()
    check_invariants(s)
    sampling = [it.request for it in items if it.samples]
    for it in items:
        s.committed(it)
    for req in sampling:
        req.output_ids.append(1000 + len(req.output_ids))
        if finish_at_max and len(req.output_ids) >= req.max_new_tokens:
            s.finish(req)
    check_invariants(s)
    return items


def run_until_idle(s: Scheduler, limit: int = 200) -> int:
    n = 0
    while s.has_work():
        step(s)
        n += 1
        assert n < limit, "scheduler made no progress"
    return n


# --------------------------------------------------------------------------- admission


def test_admission_respects_block_promise_fifo():
    s = make_sched(num_blocks=8)
    a = make_req(list(range(10)), max_new=6)          # 16 tokens -> 4 blocks
    b = make_req(list(range(20, 34)), max_new=6)      # 20 tokens -> 5 blocks: 4 + 5 > 8
    c = make_req(list(range(40, 42)), max_new=2)      # 1 block: would fit, but FIFO keeps it behind b
    for r in (a, b, c):
        s.add(r)
    s.admit()
    assert s.running == [a] and list(s.waiting) == [b, c]
    assert a.reserved_blocks == 4 and s.blocks.promised == 4
    assert b.blocks == [] and b.reserved_blocks == 0 and b.num_computed == 0

    # Nothing is admitted while a holds its promise, even across steps.
    while a.finish_reason is None and a in s.running:
        step(s, finish_at_max=False)
        assert list(s.waiting) == [b, c]
        if len(a.output_ids) >= a.max_new_tokens:
            break
    s.finish(a)
    s.admit()
    assert s.running == [b, c] and not s.waiting
    assert s.blocks.promised == 5 + 1


def test_request_larger_than_the_store_waits_while_others_run_then_fails():
    s = make_sched(num_blocks=6)
    small = make_req(list(range(6)), max_new=2)       # 2 blocks
    big = make_req(list(range(20)), max_new=4)        # 24 tokens -> 6 blocks: not next to small
    s.add(small)
    s.add(big)
    s.admit()
    assert s.running == [small] and list(s.waiting) == [big] and not s.take_failed()
    s.finish(small)
    s.admit()                                         # it fits alone: admitted as soon as the store is free
    assert s.running == [big]
    s.finish(big)
    bigger = make_req(list(range(22)), max_new=4)     # 26 tokens -> 7 blocks > 6: can never fit
    s.add(bigger)
    assert s.schedule() == []                         # fails at once instead of waiting forever
    rejected = s.take_failed()
    assert not s.waiting and [r for r, _ in rejected] == [bigger] and s.take_failed() == []
    assert isinstance(rejected[0][1], EngineError) and "7 KV blocks" in str(rejected[0][1])
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0


def test_max_num_seqs_respected():
    s = make_sched(num_blocks=32, max_num_seqs=2)
    reqs = [make_req(list(range(i * 10, i * 10 + 5)), max_new=2) for i in range(3)]
    for r in reqs:
        s.add(r)
    items = s.schedule()
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]
    assert {it.request.request_id for it in items} == {reqs[0].request_id, reqs[1].request_id}
    run_until_idle(s)
    assert all(len(r.output_ids) == 2 for r in reqs)
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0


# --------------------------------------------------------------------------- planning


def test_long_prompt_is_chunked_across_steps():
    s = make_sched(num_blocks=16, max_batch_tokens=8)
    r = make_req(list(range(20)), max_new=2)
    s.add(r)
    sizes = []
    while r.in_prefill:
        items = step(s)
        assert len(items) == 1 and items[0].request is r
        sizes.append(items[0].num_tokens)
        # Blocks are allocated lazily, just enough for the tokens computed so far.
        assert len(r.blocks) == s.blocks.blocks_for(r.num_computed)
    assert sizes == [8, 8, 4]
    assert r.output_ids == [1000]                      # only the last chunk sampled
    items = step(s)
    assert [(it.request, it.num_tokens) for it in items] == [(r, 1)]
    assert not s.has_work()


def test_decodes_first_then_prompt_chunks_under_budget():
    s = make_sched(num_blocks=32, max_batch_tokens=6)
    a = make_req(list(range(3)), max_new=5)
    s.add(a)
    first = s.schedule()
    assert [(it.request, it.num_tokens, it.samples) for it in first] == [(a, 3, True)]
    s.committed(first[0])
    assert not first[0].samples                        # samples must be read before committing
    a.output_ids.append(1000)
    b = make_req(list(range(50, 62)), max_new=2)       # 12-token prompt
    c = make_req(list(range(70, 74)), max_new=2)
    s.add(b)
    s.add(c)
    items = step(s)
    # a decodes (1 token), then b takes the rest of the budget; c gets nothing this step.
    assert [(it.request, it.num_tokens) for it in items] == [(a, 1), (b, 5)]
    assert [it.samples for it in items] == [True, False]
    items = step(s)
    assert [(it.request, it.num_tokens) for it in items] == [(a, 1), (b, 5)]
    items = step(s)
    # b finishes its prompt (2 tokens) and c starts (3 of 4) after a's decode.
    assert [(it.request, it.num_tokens) for it in items] == [(a, 1), (b, 2), (c, 3)]
    assert sum(it.num_tokens for it in items) <= 6
    items = step(s)
    # All three are decoding or finishing c's last prompt token; a reaches max_new and finishes.
    assert [(it.request, it.num_tokens) for it in items] == [(a, 1), (b, 1), (c, 1)]
    assert a not in s.running and len(a.output_ids) == 5
    run_until_idle(s)
    assert [len(r.output_ids) for r in (a, b, c)] == [5, 2, 2]


def test_step_item_samples_only_at_end_of_known_tokens():
    s = make_sched()
    r = make_req(list(range(9)), max_new=3)
    assert not StepItem(r, 4).samples and StepItem(r, 9).samples
    r.num_computed = 9
    r.output_ids.append(5)
    assert StepItem(r, 1).samples


# --------------------------------------------------------------------------- prefix reuse


PREFIX = list(range(100, 112))                         # 3 full blocks


def test_committed_advances_and_indexes_full_blocks():
    s = make_sched(num_blocks=16, max_batch_tokens=5)
    r = make_req(PREFIX + [7, 8], max_new=5)
    indexed = s.methods["prefix"].indexed         # the method's own state of each request
    s.add(r)
    step(s)
    assert r.num_computed == 5 and indexed(r).blocks == 1
    assert s.blocks.prefix.is_cached(r.blocks[0]) and not s.blocks.prefix.is_cached(r.blocks[1])
    step(s)
    assert r.num_computed == 10 and indexed(r).blocks == 2
    step(s)
    assert r.num_computed == 14 and indexed(r).blocks == 3 and r.output_ids == [1000]
    step(s)                                            # decode of token 14 (the sampled one)
    assert r.num_computed == 15 and indexed(r).blocks == 3
    step(s)                                            # token 15 fills block 3 (incl. generated tokens)
    assert r.num_computed == 16 and indexed(r).blocks == 4
    assert s.blocks.prefix.is_cached(r.blocks[3])
    s.finish(r)
    assert indexed.get(r) is None and len(indexed) == 0   # dropped with the request


def test_same_agent_reuses_prefix_but_runs_at_least_one_token():
    s = make_sched(num_blocks=16)
    first = make_req(PREFIX, max_new=2)
    s.add(first)
    run_until_idle(s)
    st = s.store.stats()
    assert st.blocks_active == 0 and st.blocks_cached >= 3
    first_blocks = [b for b in range(s.store.num_blocks) if s.blocks.prefix.is_cached(b)]

    # Identical prompt: only 2 of 3 blocks can be served, so the last block's tokens still run.
    same = make_req(PREFIX, max_new=2)
    s.add(same)
    items = s.schedule()
    assert same.cached_tokens == 8 and same.num_computed == 8
    assert same.cached_tokens < len(same.prompt_ids)
    assert set(same.blocks[:2]) <= set(first_blocks)
    assert all(s.blocks.prefix.is_cached(b) for b in same.blocks[:2])
    assert [(it.request, it.num_tokens, it.samples) for it in items] == [(same, 4, True)]
    for it in items:
        s.committed(it)
    s.finish(same)

    # Longer prompt sharing the prefix: all 3 prefix blocks are reused.
    longer = make_req(PREFIX + [1, 2, 3], max_new=2)
    s.add(longer)
    items = s.schedule()
    assert longer.cached_tokens == 12 and items[0].num_tokens == 3
    s.finish(longer)

    # Shorter-than-one-block remainder and a prompt diverging inside block 1.
    diverge = make_req(PREFIX[:6] + [0] * 6, max_new=2)
    s.add(diverge)
    s.schedule()
    assert diverge.cached_tokens == 4
    s.finish(diverge)
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0


def test_different_agent_gets_no_hits():
    s = make_sched(num_blocks=16)
    s.add(make_req(PREFIX + [1], max_new=2, agent="alice"))
    run_until_idle(s)
    bob = make_req(PREFIX + [1], max_new=2, agent="bob")
    s.add(bob)
    items = s.schedule()
    assert bob.cached_tokens == 0 and items[0].num_tokens == 13
    s.finish(bob)
    alice = make_req(PREFIX + [1], max_new=2, agent="alice")
    s.add(alice)
    s.schedule()
    assert alice.cached_tokens == 12


@pytest.mark.parametrize("reuse,prefix_stable", [("none", True), ("prefix", False)])
def test_no_reuse_without_prefix_mode_or_stable_template(reuse, prefix_stable):
    s = make_sched(num_blocks=16, reuse=reuse)
    s.add(make_req(PREFIX + [1], max_new=2, prefix_stable=prefix_stable))
    run_until_idle(s)
    assert s.store.stats().blocks_cached == 0          # nothing indexed, everything freed
    again = make_req(PREFIX + [1], max_new=2, prefix_stable=prefix_stable)
    s.add(again)
    s.schedule()
    assert again.cached_tokens == 0 and again.num_computed == 0


def test_finish_releases_blocks_and_keeps_indexed_ones_cached():
    s = make_sched(num_blocks=16)
    reqs = [make_req(PREFIX + [i, i + 1], max_new=3, agent=f"agent{i}") for i in range(3)]
    for r in reqs:
        s.add(r)
    run_until_idle(s)
    st = s.store.stats()
    indexed = [b for b in range(s.store.num_blocks) if s.blocks.prefix.is_cached(b)]
    assert st.blocks_active == 0 and s.blocks.promised == 0
    # Each agent: 14 prompt + 2 fed outputs = 16 computed tokens -> 4 full indexed blocks.
    assert st.blocks_cached == len(indexed) == 12
    assert s.store.num_available == s.store.num_blocks
    assert st.kv_bytes == 12 * s.store.block_bytes


def test_finish_of_waiting_request_and_reuse_state_reset():
    s = make_sched(num_blocks=6)
    s.add(make_req(PREFIX, max_new=2))
    run_until_idle(s)                                  # 3 prefix blocks cached
    hog = make_req(list(range(8)), max_new=8)          # 4 blocks: fits (6 available)
    s.add(hog)
    s.schedule()
    assert s.running == [hog]
    # Matches the 3 cached blocks and needs 2 more, but only 1 block is free beyond hog's promise of 2.
    late = make_req(PREFIX + [5, 6, 7, 8], max_new=4)
    s.add(late)
    s.schedule()
    assert list(s.waiting) == [late]
    assert late.blocks == [] and late.num_computed == 0 and late.cached_tokens == 0
    assert s.store.stats().blocks_active == len(hog.blocks)       # refs taken by the match were dropped
    s.finish(late)                                     # aborting a waiting request
    assert not s.waiting
    s.finish(hog)
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0


def test_cached_blocks_are_evicted_for_new_work():
    s = make_sched(num_blocks=6)
    s.add(make_req(PREFIX, max_new=2, agent="a"))
    run_until_idle(s)
    assert s.store.stats().blocks_cached == 3
    big = make_req(list(range(200, 216)), max_new=8, agent="b")   # 24 tokens -> all 6 blocks
    s.add(big)
    run_until_idle(s)
    assert len(big.output_ids) == 8
    again = make_req(PREFIX, max_new=2, agent="a")
    s.add(again)
    s.schedule()
    assert again.cached_tokens == 0                      # big needed every block: a's were all evicted
    assert s.store.stats().peak_blocks == 6


def test_side_request_reserve_and_release_leave_no_trace():
    """The ahead-of-time path (engine/prefetch.py): plan, reserve what fits next to running requests'
    promises, release everything afterwards."""
    s = make_sched(num_blocks=8)
    running = make_req(list(range(BS * 3)), max_new=BS)       # promises 4 blocks
    s.add(running)
    s.admit()
    side = make_req(list(range(100, 100 + BS * 3)))
    s.plan(side)
    assert not s.blocks.reserve(side, BS * 5)   # 5 blocks: only 4 are not promised
    assert side.blocks == [] and s.blocks.promised == 4
    assert s.blocks.reserve(side, BS * 3)
    assert len(side.blocks) == 3 and s.blocks.promised == 4   # allocated, so no longer merely promised
    s.release(side)
    assert side.blocks == [] and side.reserved_blocks == 0
    check_invariants(s)
    s.finish(running)
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0


def test_own_holes_gives_only_what_fits_next_to_the_promises():
    """A running request may take blocks beyond its promise for its holes (a decode copy of its view),
    never ones promised to another; then it owns all of its reused span."""
    s = make_sched(num_blocks=8)
    running = make_req(list(range(BS * 3)), max_new=BS)       # promises 4 blocks
    s.add(running)
    s.admit()
    wide, narrow = make_req(list(range(100, 100 + BS * 6))), make_req(list(range(200, 200 + BS * 4)))
    for req, end in ((wide, BS * 5), (narrow, BS * 3)):       # a new token in block 1, the rest reused
        s.blocks.apply_plan(req, ReusePlan(reuse_end=end, own_spans=((BS, BS + 1),)))
        assert s.blocks.reserve(req, end)
    assert wide.blocks[0] == wide.blocks[2] == -1 and wide.blocks[1] >= 0 and s.blocks.room == 2
    assert not s.blocks.own_holes(wide)   # 4 holes, room for 2: nothing changes
    assert wide.blocks.count(-1) == 4 and wide.own_prefix_end == 0 and wide.is_hole(0, BS)
    assert s.blocks.own_holes(narrow) and s.blocks.room == 0 and min(narrow.blocks) >= 0
    assert narrow.own_prefix_end == narrow.reuse_end and narrow.own_spans == () and not narrow.is_hole(0, BS)
    s.release(wide)
    s.release(narrow)
    s.finish(running)
    assert s.store.stats().blocks_active == 0 and s.blocks.promised == 0



# --------------------------------------------------------------------------- work off the critical path


class _Queued(ReuseMethod):
    """A method with ``units`` of idle work queued; ``fail`` makes its work raise."""

    name = "queued"

    def __init__(self, ctx: ReuseContext, units: int, fail: bool = False):
        super().__init__(ctx)
        self.units, self.fail, self.dropped = units, fail, 0

    def idle(self, busy: set[str]) -> bool:
        if not self.units:
            return False
        if self.fail:
            raise RuntimeError("prefetch broke")
        self.units -= 1
        return True

    def drop_idle_work(self) -> None:
        self.units, self.dropped = 0, self.dropped + 1


def test_idle_runs_one_unit_a_call_and_says_whether_there_was_any():
    s = make_sched()
    q = s.methods["queued"] = _Queued(s.methods["prefix"].ctx, 2)
    assert [s.idle(), s.idle(), s.idle()] == [True, True, False] and q.units == 0
    s.add(make_req(list(range(6))))
    q.units = 1
    assert s.idle() and q.units == 1                  # a request waits: idle work does not run
    run_until_idle(s)
    f = s.methods["queued"] = _Queued(s.methods["prefix"].ctx, 3, fail=True)
    assert s.idle() and f.units == 0 and f.dropped == 1          # raised: dropped, counted, not raised
    assert s.counters.snapshot()[0]["idle_work_failed"] == 1 and not s.idle()
