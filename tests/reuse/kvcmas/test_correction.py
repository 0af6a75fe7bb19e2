"""KVCMAS cross-agent reuse on the real default model: fidelity against exact prefill, not time."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvcmas_agents import Engine, EngineConfig, SamplingParams
from kvcmas_agents.engine import ReuseOptions
from kvcmas_agents.reuse.kvcmas.correction import UNCORRECTED_LAYERS
from kvcmas_agents.reuse.storage.delta import unique_nbytes
from kvcmas_agents.fidelity import CSV_SYSTEM as SYSTEM
from kvcmas_agents.fidelity import CSV_TASK as TASK
from kvcmas_agents.fidelity import kl
from kvcmas_agents import KVCMASConfig, StorageSpec

FIRST = SamplingParams(max_tokens=1, return_logits=True)


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(reuse="none"))
    yield eng
    eng.close()


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM[agent]}] + history


async def test_kvcmas_is_much_closer_to_exact_than_naive(engine, csv_history):
    history = await csv_history(engine)
    # The leading agent computes the shared segments exactly; the others reuse them.
    for mode in ("naive", "kvcmas"):
        await engine.generate(prompt("planner", history), agent="planner", sampling=FIRST,
                              reuse_options=ReuseOptions(reuse=mode))
    kls = {"naive": [], "kvcmas": []}
    for agent in ("coder", "reviewer"):
        exact = await engine.generate(prompt(agent, history), agent=agent, sampling=FIRST,
                                      reuse_options=ReuseOptions(reuse="none"))
        for mode in kls:
            out = await engine.generate(prompt(agent, history), agent=agent + "-" + mode, sampling=FIRST,
                                        reuse_options=ReuseOptions(reuse=mode))
            assert out.usage.reused_tokens > 0.6 * out.usage.prompt_tokens
            assert out.reuse == mode
            if mode == "kvcmas":
                assert 0 < out.usage.recomputed_tokens < out.usage.reused_tokens
            else:
                assert out.usage.recomputed_tokens == 0
            kls[mode].append(kl(exact.logits[0], out.logits[0]))
    naive, ours = sum(kls["naive"]) / 2, sum(kls["kvcmas"]) / 2
    assert naive > 0.002                 # the problem is real on this conversation
    assert ours < naive / 3, kls


async def test_full_recompute_equals_exact(engine, csv_history):
    history = await csv_history(engine, turns=2)
    await engine.generate(prompt("planner", history), agent="p1", sampling=FIRST,
                          reuse_options=ReuseOptions(reuse="kvcmas"))
    greedy = SamplingParams(max_tokens=24, return_logits=True)
    exact = await engine.generate(prompt("reviewer", history), agent="r1", sampling=greedy,
                                  reuse_options=ReuseOptions(reuse="none"))
    full = await engine.generate(prompt("reviewer", history), agent="r1", sampling=greedy,
                                 reuse_options=ReuseOptions(reuse="kvcmas", recompute_ratio=1.0))
    assert full.usage.recomputed_tokens == full.usage.reused_tokens > 0
    assert full.token_ids == exact.token_ids
    mine = [c.own for c in engine.segments._corrections.values() if c.agent == "r1"]
    assert mine and all(s.first_layer == 0 for s in mine)     # ratio 1.0 stores every layer: it stays exact
    assert torch.allclose(full.logits[0], exact.logits[0], atol=2e-3)


async def test_corrections_persist_across_turns(engine, csv_history):
    history = await csv_history(engine, turns=2)
    opts = ReuseOptions(reuse="kvcmas")
    await engine.generate(prompt("planner", history), agent="p2", sampling=FIRST, reuse_options=opts)
    first = await engine.generate(prompt("coder", history), agent="c2", sampling=FIRST, reuse_options=opts)
    again = await engine.generate(prompt("coder", history), agent="c2", sampling=FIRST, reuse_options=opts)
    assert first.usage.recomputed_tokens > 0
    assert again.usage.recomputed_tokens == 0            # held correction reused, not recomputed
    assert again.usage.reused_tokens + again.usage.cached_tokens >= first.usage.reused_tokens
    assert torch.allclose(first.logits[0], again.logits[0], atol=1e-4)
    stats = engine.stats()
    assert stats["reuse"]["kvcmas"]["corrections"] > 0 and stats["reuse"]["kvcmas"]["correction_bytes"] > 0
    assert 0 < stats["reuse"]["kvcmas"]["correction_basis_bytes"] < stats["reuse"]["kvcmas"]["correction_bytes"]
    assert stats["reuse"]["kvcmas"]["correction_bytes_by_agent"]["c2"] > 0


async def test_chain_reference_composes(engine, csv_history):
    history = await csv_history(engine, turns=2)
    engine.set_edges([("p3", "c3"), ("c3", "r3")])
    try:
        opts = ReuseOptions(reuse="kvcmas", reference="chain")
        await engine.generate(prompt("planner", history), agent="p3", sampling=FIRST, reuse_options=opts)
        await engine.generate(prompt("coder", history), agent="c3", sampling=FIRST, reuse_options=opts)
        out = await engine.generate(prompt("reviewer", history), agent="r3", sampling=FIRST, reuse_options=opts)
        exact = await engine.generate(prompt("reviewer", history), agent="r3x", sampling=FIRST,
                                      reuse_options=ReuseOptions(reuse="none"))
        chains = [c for (a, _, _, _), c in engine.segments._corrections.items() if a == "r3"]
        preds = [c for (a, _, _, _), c in engine.segments._corrections.items() if a == "c3"]
        # r3's view = c3's chain (rotated to r3's positions) + r3's own delta.
        assert chains and all(c.reference == "chain" for c in chains)
        assert max(len(c.chain) for c in chains) == max(len(c.chain) for c in preds) + 1
        assert kl(exact.logits[0], out.logits[0]) < 0.05
    finally:
        engine.set_edges([])


async def test_kv_returns_to_home_view_baseline(engine, csv_history):
    import asyncio
    history = await csv_history(engine, turns=1)
    opts = ReuseOptions(reuse="kvcmas")
    await engine.generate(prompt("planner", history), agent="p4", sampling=FIRST, reuse_options=opts)
    await asyncio.gather(*[engine.generate(prompt(a, history), agent=a + "4", sampling=SamplingParams(max_tokens=8),
                                           reuse_options=opts) for a in ("coder", "reviewer")])
    while engine.scheduler.has_work():
        await asyncio.sleep(0.02)
    stats = engine.stats()
    assert stats["memory"]["blocks_in_use"] == len(engine.segments.home_blocks)
    assert stats["memory"]["kv_bytes"] == stats["memory"]["home_view_bytes"] + stats["memory"]["kv_bytes_cached"]


async def test_home_views_pack_their_partial_blocks_and_serve_the_same_kv():
    """Home views hold about one block per 16 of their tokens (partial blocks' tokens are packed,
    engine/home_pack.py), and a later agent's result is the same as with every partial block held."""
    held, outs = {}, {}
    for pack in (True, False):
        eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
        if not pack:
            eng.segments.packer.can_allocate = lambda: False     # hold partial blocks in place
        try:
            history = [{"role": "user", "content": TASK}]
            for agent in ("planner", "coder"):
                out = await eng.generate(prompt(agent, history), agent=agent, sampling=SamplingParams(max_tokens=24))
                history.append({"role": "user", "content": f"[{agent}] {out.text}"})
            outs[pack] = await eng.generate(prompt("reviewer", history), agent="reviewer", sampling=FIRST)
            held[pack] = eng.stats()
        finally:
            eng.close()
    bs, block = held[True]["engine"]["block_size"], held[True]["memory"]["block_bytes"]
    homes = {pack: held[pack]["reuse"]["home_views"] for pack in held}
    assert homes[True]["tokens"] == homes[False]["tokens"]
    assert homes[True]["bytes"] <= (homes[True]["tokens"] // bs + 1) * block
    assert homes[True]["bytes"] < homes[False]["bytes"]
    assert held[True]["memory"]["blocks_in_use"] < held[False]["memory"]["blocks_in_use"]
    assert torch.equal(outs[True].logits[0], outs[False].logits[0])


async def test_new_text_between_reused_segments(engine, csv_history):
    history = await csv_history(engine, turns=2)
    await engine.generate(prompt("planner", history), agent="p5", sampling=FIRST,
                          reuse_options=ReuseOptions(reuse="kvcmas"))
    # A message nobody has seen, in the middle: the segments after it are still reused.
    middle = history[:1] + [{"role": "user", "content": "Moderator: reviewer, focus on error handling."}] + history[1:]
    greedy = SamplingParams(max_tokens=16, return_logits=True)
    exact = await engine.generate(prompt("reviewer", middle), agent="r5x", sampling=greedy,
                                  reuse_options=ReuseOptions(reuse="none"))
    full = await engine.generate(prompt("reviewer", middle), agent="r5", sampling=greedy,
                                 reuse_options=ReuseOptions(reuse="kvcmas", recompute_ratio=1.0))
    plain = await engine.generate(prompt("reviewer", history), agent="r7", sampling=FIRST,
                                  reuse_options=ReuseOptions(reuse="kvcmas"))
    # Every segment reused without the new message is still reused with it.
    assert full.usage.reused_tokens == plain.usage.reused_tokens > 0
    assert full.token_ids == exact.token_ids
    default = await engine.generate(prompt("reviewer", middle), agent="r6", sampling=greedy,
                                    reuse_options=ReuseOptions(reuse="kvcmas"))
    # By now the system prompt and the middle message have home views too (from r5).
    assert default.usage.reused_tokens + default.usage.cached_tokens > full.usage.reused_tokens
    assert kl(exact.logits[0], default.logits[0]) < 0.05


async def test_query_and_gather_view_paths_agree():
    history = [{"role": "user", "content": TASK}, {"role": "user", "content": "[planner] 1. Read the file. 2. Sum."}]
    outs = []
    for path in ("gather", "query"):
        eng = Engine(EngineConfig(reuse="kvcmas", view_path=path))
        try:
            await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
            outs.append(await eng.generate(prompt("coder", history), agent="coder",
                                           sampling=SamplingParams(max_tokens=4, return_logits=True)))
        finally:
            await eng.aclose()
    assert outs[0].usage.reused_tokens == outs[1].usage.reused_tokens > 0
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.allclose(a, b, atol=1e-3)


async def assert_closer_than_naive(exact_engine: Engine, ours: Engine, messages: list[dict], got) -> None:
    """got's first token is closer to exact prefill than naive reuse of the same prompt on ``ours`` is."""
    exact = await exact_engine.generate(messages, agent="exact", sampling=FIRST,
                                        reuse_options=ReuseOptions(reuse="none"))
    naive = await ours.generate(messages, agent="naive-control", sampling=FIRST,
                                reuse_options=ReuseOptions(reuse="naive"))
    assert kl(exact.logits[0], got.logits[0]) < kl(exact.logits[0], naive.logits[0])


async def test_a_reply_is_reused_from_its_generating_agents_decode(engine):
    """DESIGN.md step 5: a reply's home view is its generating agent's decode, found inside the next
    agent's message (whose role header differs), then corrected like any reused segment."""
    ours = Engine(EngineConfig(reuse="kvcmas"))
    try:
        history = [{"role": "user", "content": TASK}]
        reply = await ours.generate(prompt("planner", history), agent="planner",
                                    sampling=SamplingParams(max_tokens=24, ignore_eos=True))
        assert ours.stats()["reuse"]["home_views"]["count"] >= 3              # system, task, and the decoded reply
        seen = history + [{"role": "user", "content": f"[planner]\n{reply.text}"}]
        other = history + [{"role": "user", "content": f"[planner]\nNote: {reply.text}"}]   # no whole match
        got = await ours.generate(prompt("coder", seen), agent="coder", sampling=FIRST)
        ctl = await ours.generate(prompt("coder", other), agent="coder-control", sampling=FIRST)
        # The decoded tokens with KV (all but the last sampled one) are reused, not prefilled.
        assert got.usage.reused_tokens >= ctl.usage.reused_tokens + reply.usage.completion_tokens - 1
        await assert_closer_than_naive(engine, ours, prompt("coder", seen), got)
    finally:
        await ours.aclose()


async def test_the_frame_around_a_reused_reply_is_reused_by_later_agents(engine):
    """The role header and trailer around a decoded reply are new text for the first agent that renders
    the message; they become home views, so later agents reuse and correct them instead of recomputing
    every message's frame on every turn."""
    ours = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    try:
        history = [{"role": "user", "content": TASK}]
        reply = await ours.generate(prompt("planner", history), agent="planner",
                                    sampling=SamplingParams(max_tokens=24, ignore_eos=True))
        seen = history + [{"role": "user", "content": f"[planner]\n{reply.text}"}]
        homes = ours.stats()["reuse"]["home_views"]["count"]
        first = await ours.generate(prompt("coder", seen), agent="coder", sampling=FIRST)
        assert ours.stats()["reuse"]["home_views"]["count"] >= homes + 2          # the header and the trailer
        later = await ours.generate(prompt("reviewer", seen), agent="reviewer", sampling=FIRST)
        assert later.usage.reused_tokens > first.usage.reused_tokens
        # Frames are recomputed whole when an agent first corrects them (they were new text before),
        # whatever the ratio; at ratio 0 nothing else is.
        bare = await ours.generate(prompt("reviewer", seen), agent="reviewer-r0", sampling=FIRST,
                                   reuse_options=ReuseOptions(recompute_ratio=0.0))
        assert bare.usage.recomputed_tokens == later.usage.reused_tokens - first.usage.reused_tokens > 0
        await assert_closer_than_naive(engine, ours, prompt("reviewer", seen), later)
    finally:
        await ours.aclose()


async def test_correction_factors_are_stored_compactly_at_close_fidelity(engine, csv_history):
    """Factors keep U in int8 (B in bf16, carrying U's scales) for keys and values ("int8"); value_bits=4
    keeps the values as 4-bit rows instead (one bf16 scale per row, no B_v), key_bits=4 the keys too
    (after per-channel scales, no B_k); "int8_basis" keeps B in int8 too, and the default
    u8_components=28 with it stores U's last 12 components as 4-bit codes ("lean", with
    u_head_bits=8), and the default u_head_bits=6 its leading 28 in 6 bits. The default small_rows
    keeps this small correction's rows, in fewer bytes than its factors: in 6 bits (default
    small_row_bits), three quarters of the 8-bit rows' bytes. Each stays far closer to exact than the
    same reuse uncorrected. (Every layer from 1 is stored here: uncorrected_energy=0.)"""
    history = await csv_history(engine, turns=2)
    opts = ReuseOptions(reuse="kvcmas")
    states, outs = {}, {}
    factors = {"small_rows": False}
    int8 = {"dtype": "int8", "u8_components": None, "u_head_bits": 8}   # before 4-bit tails
    kinds = {"int8": {**int8, **factors}, "value_rows": {"value_bits": 4, **int8, **factors},
             "key_rows": {"key_bits": 4, "value_bits": 4, **int8},
             "int8_basis": {**int8, "dtype": "int8_basis", **factors},
             "lean": {**factors, "u_head_bits": 8}, "bfloat16": {"dtype": "bfloat16"},
             "float32": {"dtype": "float32"}, "small_rows": {**int8, "small_row_bits": 8},
             "small_rows6": int8, "head6": factors}
    spec = EngineConfig().kvcmas.storage
    assert (spec.dtype, spec.value_bits, spec.key_bits, spec.small_rows, spec.small_row_bits, spec.u8_components,
            spec.u_head_bits) == ("int8_basis", 0, 0, True, 6, 28, 6)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="u8_components"):
            EngineConfig(methods={"kvcmas": KVCMASConfig(storage=StorageSpec(u8_components=bad))})
    for bad in (0, 5, 7, True):
        with pytest.raises(ValueError, match="small_row_bits"):
            EngineConfig(methods={"kvcmas": KVCMASConfig(storage=StorageSpec(small_row_bits=bad))})
    for bad in (0, 4, 7, True):
        with pytest.raises(ValueError, match="u_head_bits"):
            EngineConfig(methods={"kvcmas": KVCMASConfig(storage=StorageSpec(u_head_bits=bad))})
    for kind, knobs in kinds.items():
        storage = StorageSpec(uncorrected_energy=0.0, **knobs)
        eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, storage=storage)}))
        try:
            await eng.generate(prompt("planner", history), agent="p", sampling=FIRST, reuse_options=opts)
            outs[kind] = await eng.generate(prompt("coder", history), agent="c", sampling=FIRST, reuse_options=opts)
            states[kind] = [c.own for c in eng.segments._corrections.values()]
            assert outs[kind].usage.recomputed_tokens > 0
            if kind == "int8":               # the same reuse, uncorrected
                outs["naive"] = await eng.generate(prompt("coder", history), agent="c-naive", sampling=FIRST,
                                                   reuse_options=ReuseOptions(reuse="naive"))
                assert outs["naive"].usage.reused_tokens == outs[kind].usage.reused_tokens
        finally:
            eng.close()
    layers = engine.model.args.num_layers
    for kind, held in states.items():       # layer 0's deviation is rounding: no state stores it
        assert all(s.first_layer == UNCORRECTED_LAYERS == 1 and s.k.u.shape[0] == layers - 1 for s in held), kind
    dtypes = {k: ({s.k.u.dtype for s in v}, {None if s.k.b is None else s.k.b.dtype for s in v},
                  {s.v.u.dtype for s in v}, {None if s.v.b is None else s.v.b.dtype for s in v})
              for k, v in states.items()}
    assert dtypes["int8"] == ({torch.int8}, {torch.bfloat16}, {torch.int8}, {torch.bfloat16})
    assert dtypes["value_rows"] == ({torch.int8}, {torch.bfloat16}, {torch.uint8}, {None})
    assert dtypes["key_rows"] == ({torch.uint8}, {None}, {torch.uint8}, {None})
    assert dtypes["int8_basis"] == dtypes["lean"] == ({torch.int8}, {torch.int8}, {torch.int8}, {torch.int8})
    assert all(s.k.tail4 == s.v.tail4 == 0 for s in states["int8_basis"])
    assert all(s.rank == 40 and s.k.tail4 == s.v.tail4 == 12 and s.k.u.shape[-1] == 34 for s in states["lean"])
    assert all(s.rank == 40 and s.k.head_bits == s.v.head_bits == 6 and s.k.u.shape[-1] == 21 + 6
               for s in states["head6"])
    assert dtypes["bfloat16"][0] == {torch.bfloat16} and dtypes["float32"][0] == {torch.float32}
    assert dtypes["small_rows"] == ({torch.int8}, {None}, {torch.int8}, {None})
    assert all(s.k.row_scale is not None and s.k.channel_scale is not None and s.v.row_scale is not None
               for s in states["small_rows"])
    assert sum(s.num_rows for s in states["small_rows"]) == sum(s.num_rows for s in states["int8"]) < 192
    assert dtypes["small_rows6"] == ({torch.uint8}, {None}, {torch.uint8}, {None})
    assert all(s.k.row_bits == s.v.row_bits == 6 and s.k.channel_scale is not None for s in states["small_rows6"])
    assert all(s.k.row_bits == s.v.row_bits == 8 for s in states["small_rows"])
    assert [s.rows.tolist() for s in states["small_rows6"]] == [s.rows.tolist() for s in states["small_rows"]]
    u_bytes = {d: sum(s.k.u.nbytes + s.v.u.nbytes for s in states[d]) for d in ("int8", "bfloat16", "float32")}
    assert u_bytes["int8"] * 4 == u_bytes["bfloat16"] * 2 == u_bytes["float32"]
    b_bytes = {d: unique_nbytes(states[d], bases_only=True) for d in states}
    assert b_bytes["int8"] == b_bytes["bfloat16"] == 2 * b_bytes["value_rows"]      # no B_v with value rows
    assert b_bytes["bfloat16"] * 2 == b_bytes["float32"] and b_bytes["int8_basis"] < 0.3 * b_bytes["float32"]
    total = {d: unique_nbytes(states[d]) for d in states}
    assert total["key_rows"] < 0.85 * total["value_rows"] < 0.85 ** 2 * total["int8"]
    assert total["small_rows"] < total["int8"]
    assert 0.7 * total["small_rows"] < total["small_rows6"] < 0.8 * total["small_rows"]
    assert total["head6"] < total["lean"] < total["int8_basis"] < total["int8"]
    exact = await engine.generate(prompt("coder", history), agent="c-exact", sampling=FIRST,
                                  reuse_options=ReuseOptions(reuse="none"))
    off = {k: kl(exact.logits[0], o.logits[0]) for k, o in outs.items()}
    for kind in kinds:                   # e.g. naive 0.015; int8 factors 0.0005, 4-bit value rows 0.0013
        assert off[kind] < off["naive"] / 8, off


async def test_the_newest_reused_message_is_recomputed_whole(engine, csv_history):
    """With recompute_newest (default), every row of the message right before the tail is recomputed on
    top of recompute_ratio; without it, only the ratio's share of the rows is."""
    history = await csv_history(engine, turns=3)
    newest = {}
    for on in (True, False):
        eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, recompute_newest=on,
                                                                                  recompute_ratio=0.25)}))
        try:
            await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
            out = await eng.generate(prompt("coder", history), agent="coder", sampling=FIRST)
            corrs = [(key[1], c) for key, c in eng.segments._corrections.items() if c.agent == "coder"]
            tokens, last = max(corrs, key=lambda kc: kc[1].start)
            newest[on] = (last.recomputed, len(tokens), out.usage.recomputed_tokens)   # stored or not
        finally:
            eng.close()
    (rows_on, size, rec_on), (rows_off, size_off, rec_off) = newest[True], newest[False]
    assert size == size_off and rows_on == size > rows_off > 0
    assert rec_on > rec_off


async def test_a_long_newest_message_is_recomputed_whole_only_near_the_tail(engine, monkeypatch, csv_history):
    """A newest reused message longer than NEWEST_SPAN (a long code block): only its rows within
    NEWEST_SPAN tokens of the tail are forced; its earlier rows compete by attention mass like older
    history's. The request still lands close to exact."""
    from kvcmas_agents.reuse.kvcmas import correction, select

    history = await csv_history(engine, turns=1)
    code = "\n".join(f"def step_{i}(rows):\n    return [r for r in rows if r.region == 'r{i % 7}' and r.amount > {i}]"
                     for i in range(16))
    history.append({"role": "user", "content": "[coder]\n```python\n" + code + "\n```"})
    picked = []

    def spy(view, pending, newest_whole):
        rows, capped = select.select_rows(view, pending, newest_whole)
        picked.append((view.reuse_end, [(p.start, p.end) for p in pending], rows))
        return rows, capped

    monkeypatch.setattr(correction, "select_rows", spy)
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, recompute_ratio=0.25)}))
    try:
        await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
        out = await eng.generate(prompt("coder", history), agent="coder", sampling=FIRST)
    finally:
        eng.close()
    (end, spans, rows), = picked
    (start, stop), newest = max(zip(spans, rows), key=lambda sr: sr[0][0])
    assert stop - start > 2 * select.NEWEST_SPAN
    chosen = set((start + newest).tolist())
    assert set(range(max(start, end - select.NEWEST_SPAN), stop)) <= chosen    # the last NEWEST_SPAN: all
    assert len(chosen) < (stop - start) * 0.75                                # the rest: by mass
    exact = await engine.generate(prompt("coder", history), agent="coder", sampling=FIRST,
                                  reuse_options=ReuseOptions(reuse="none"))
    assert kl(exact.logits[0], out.logits[0]) < 0.01


async def test_a_long_own_tail_selects_rows_by_its_last_tokens(engine, selection_queries, csv_history):
    """A later agent whose own tail is a long new message (a tool's output): the selection pass runs
    only the prompt's last SELECT_MAX tokens, not a second pass over the whole tail, and the request
    still corrects its reused rows close to exact."""
    from kvcmas_agents.reuse.kvcmas import select

    history = await csv_history(engine, turns=2)
    # Shared notes long enough that the pass spares more rows than its SELECT_MAX queries cost.
    notes = "\n".join(f"Note {i}: table t{i % 9} keeps column c{i} as {('int', 'text', 'date')[i % 3]}, "
                      f"indexed when {i} is even." for i in range(40))
    history.insert(1, {"role": "user", "content": "Design notes:\n" + notes})
    log = "\n".join(f"Log {i}: worker w{i % 5} processed batch b{i} in {10 + i % 37} ms, status ok."
                    for i in range(60))
    later = history + [{"role": "user", "content": "Tool output:\n" + log}]
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, recompute_ratio=0.25)}))
    try:
        await eng.generate(prompt("planner", history), agent="planner", sampling=FIRST)
        out = await eng.generate(prompt("coder", later), agent="coder", sampling=FIRST)
        assert out.usage.prompt_tokens - out.usage.reused_tokens > 2 * select.SELECT_MAX
        assert selection_queries == [select.SELECT_MAX] and eng.stats()["reuse"]["kvcmas"]["selections_capped"] == 1
        assert 0 < out.usage.recomputed_tokens < out.usage.reused_tokens
    finally:
        eng.close()
    exact = await engine.generate(prompt("coder", later), agent="coder", sampling=FIRST,
                                  reuse_options=ReuseOptions(reuse="none"))
    assert kl(exact.logits[0], out.logits[0]) < 0.01


async def test_the_newest_reply_and_the_hand_off_after_it_are_recomputed_whole():
    """A reply followed by a short hand-off line: no prefetch could correct that reply (it was not
    decoded yet), so it is recomputed whole along with the hand-off; older messages keep the ratio."""
    ours = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False, recompute_ratio=0.25)}))
    try:
        history = [{"role": "user", "content": TASK}]
        reply = await ours.generate(prompt("planner", history), agent="planner",
                                    sampling=SamplingParams(max_tokens=24, ignore_eos=True))
        seen = history + [{"role": "user", "content": f"[planner]\n{reply.text}"},
                          {"role": "user", "content": "Coder, your turn: write the function now."}]
        await ours.generate(prompt("reviewer", seen), agent="reviewer", sampling=FIRST)   # homes the hand-off
        await ours.generate(prompt("coder", seen), agent="coder", sampling=FIRST)
        segments = ours.segments
        mine = sorted((c.start, segments.lookup(key[1]).decoded, c.recomputed, len(key[1]))
                      for key, c in segments._corrections.items() if c.agent == "coder")
        task, handoff = mine[0], mine[-1]
        replies = [m for m in mine if m[1]]
        assert len(replies) == 1 and replies[0][2] == replies[0][3] > 0      # the reply, whole
        assert handoff[2] == handoff[3] > 0 and not handoff[1]                # the hand-off, whole
        assert 0 < task[2] < task[3] / 2                                      # the task, at the ratio
    finally:
        await ours.aclose()


async def coder_turns(exact_engine: Engine, history: list[dict], later: list[dict], check: bool, **storage):
    """A kvcmas engine with ``storage`` knobs: the planner's turn, then the coder's over ``history`` and over
    ``later``. Returns (stats, coder's first output, its second, the held states); ``check`` asserts
    the second is closer to exact than naive reuse."""
    opts = ReuseOptions(reuse="kvcmas")
    eng = Engine(EngineConfig(reuse="kvcmas",
                              methods={"kvcmas": KVCMASConfig(prefetch=False, storage=StorageSpec(**storage))}))
    try:
        await eng.generate(prompt("planner", history), agent="p", sampling=FIRST, reuse_options=opts)
        first = await eng.generate(prompt("coder", history), agent="c", sampling=FIRST, reuse_options=opts)
        again = await eng.generate(prompt("coder", later), agent="c", sampling=FIRST, reuse_options=opts)
        if check:
            await assert_closer_than_naive(exact_engine, eng, prompt("coder", later), again)
        return eng.stats()["reuse"]["kvcmas"], first, again, [c.own for c in eng.segments._corrections.values()]
    finally:
        eng.close()


async def test_faint_rows_are_not_stored_but_still_counted_as_recomputed(engine, csv_history):
    """correction_energy < 1 (0.95 here; the default 1.0 keeps every row) stores the strongest
    recomputed rows only; the rest are dropped and counted, recomputed_tokens still says what was
    recomputed, and an agent reusing its stored corrections next turn stays much closer to exact."""
    history = await csv_history(engine, turns=2)
    later = history + [{"role": "user", "content": "[reviewer] Please also handle quoted fields."}]
    assert EngineConfig().kvcmas.storage.correction_energy == 1.0
    default = 0.95
    stats, outs = {}, {}
    for energy in (1.0, default):
        stats[energy], *outs[energy], _ = await coder_turns(engine, history, later, energy < 1.0,
                                                            correction_energy=energy)
    assert stats[1.0]["rows_dropped"] == 0 < stats[default]["rows_dropped"]
    assert stats[default]["correction_bytes"] < stats[1.0]["correction_bytes"]
    assert outs[default][0].usage.recomputed_tokens == outs[1.0][0].usage.recomputed_tokens > 0
    exact = await engine.generate(prompt("coder", later), agent="exact", sampling=FIRST,
                                  reuse_options=ReuseOptions(reuse="none"))
    assert kl(exact.logits[0], outs[default][1].logits[0]) < 0.01
    with pytest.raises(ValueError, match="correction_energy"):
        EngineConfig(methods={"kvcmas": KVCMASConfig(storage=StorageSpec(correction_energy=0.0))})


async def test_faint_leading_layers_are_not_stored_and_are_counted(engine, csv_history):
    """uncorrected_energy > 0 (default 0.01) leaves out the leading layers that hold that share of a
    request's deviation (keys and values each): its states start at a later layer, in fewer bytes,
    the layers are counted in the stats, recomputed_tokens is unchanged, and the turn stays close to
    exact."""
    history = await csv_history(engine, turns=2)
    later = history + [{"role": "user", "content": "[reviewer] Please also handle quoted fields."}]
    default = EngineConfig().kvcmas.storage.uncorrected_energy
    assert default == 0.01
    stats, outs, firsts = {}, {}, {}
    for share in (0.0, default):
        stats[share], *outs[share], held = await coder_turns(engine, history, later, share > 0,
                                                             uncorrected_energy=share)
        firsts[share] = {s.first_layer for s in held}
    assert firsts[0.0] == {UNCORRECTED_LAYERS} and min(firsts[default]) > UNCORRECTED_LAYERS
    assert stats[0.0]["layers_dropped"] == 0 < stats[default]["layers_dropped"]
    assert stats[default]["settings"]["storage"]["uncorrected_energy"] == default
    assert stats[default]["correction_bytes"] < stats[0.0]["correction_bytes"]
    assert outs[default][0].usage.recomputed_tokens == outs[0.0][0].usage.recomputed_tokens > 0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="uncorrected_energy"):
            EngineConfig(methods={"kvcmas": KVCMASConfig(storage=StorageSpec(uncorrected_energy=bad))})


@pytest.mark.parametrize("name", ["value_bits", "key_bits"])
@pytest.mark.parametrize("bad", [3, 16, True, -4])
def test_row_bits_outside_0_4_8_are_refused(name, bad):
    with pytest.raises(ValueError, match=name):
        StorageSpec(**{name: bad})


async def test_concurrent_siblings_compute_their_shared_new_text_and_prefill_together():
    """A fan-out's first group: three declared experts get the same new task at once. None reuses the
    task from whichever sibling the worker ran first (only homes older than a request count, so the
    result does not depend on admission timing), and the two that arrive during the first one's step
    prefill in one step (their reused pieces need no correction work)."""
    from kvcmas_agents.fidelity.scenarios import FANOUT, declare_systems, prompt_messages

    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        engine.set_edges(FANOUT.edges)
        declare_systems(engine, FANOUT)
        prefills: list[int] = []
        schedule = engine.scheduler.schedule

        def recording():
            items = schedule()
            prefills.append(sum(1 for it in items if it.num_tokens > 1))
            return items

        engine.scheduler.schedule = recording
        _, group, handoff = FANOUT.schedule()[0]
        outs = await asyncio.gather(*(engine.generate(prompt_messages(FANOUT, a, [("moderator", handoff)]), agent=a,
                                                      sampling=SamplingParams(max_tokens=2)) for a in group))
        assert all(o.usage.reused_tokens == 0 and o.usage.cached_tokens > 0 for o in outs)
        assert max(prefills) >= 2, prefills
    finally:
        await engine.aclose()


async def test_an_agents_tool_loop_reads_its_own_earlier_turns_exactly(engine, csv_history):
    """A ReAct loop: an agent's next turn is its previous prompt, its reply and a tool result. The
    generation prompt and the reply decoded from it are one exact home, and once the reply's trailer
    is computed the whole message is; so the next turn computes only the new text, with no correction
    or recompute pass over the view."""
    ours = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    try:
        history = await csv_history(engine, turns=2)
        messages = prompt("reviewer", history)
        out = await ours.generate(prompt("planner", history), agent="planner", sampling=FIRST)
        outs = []
        for i, result in enumerate(["tool: 3 tests failed", "tool: all 12 tests passed", "tool: lint clean"]):
            # (replies of different lengths: a reply that repeats an earlier one is corrected, not exact)
            out = await ours.generate(messages, agent="reviewer", sampling=SamplingParams(max_tokens=10 + 2 * i))
            outs.append(out)
            messages = messages + [{"role": "assistant", "content": out.text},
                                   {"role": "user", "content": f"{result} (run {i})"}]
        first, *later = outs
        assert first.usage.reused_tokens > 0 and "recompute" in first.timings
        for prev, cur in zip(outs, later):
            new = cur.usage.prompt_tokens - prev.usage.prompt_tokens - prev.usage.completion_tokens
            computed = cur.usage.prompt_tokens - cur.usage.cached_tokens - cur.usage.reused_tokens
            assert cur.usage.recomputed_tokens == 0 and "recompute" not in cur.timings
            assert cur.usage.reused_tokens == first.usage.reused_tokens        # the history's corrections
            assert computed <= new + 4        # the new text (and the reply's trailer), never the reply
            assert cur.usage.cached_tokens >= prev.usage.prompt_tokens - prev.usage.reused_tokens
        # The own homes are home views like the others: between requests only home views hold blocks.
        stats = ours.stats()
        assert stats["memory"]["blocks_in_use"] == len(ours.segments.home_blocks)
        assert stats["memory"]["kv_bytes"] == stats["memory"]["home_view_bytes"] + stats["memory"]["kv_bytes_cached"]
        ours.segments.clear()
        assert ours.stats()["memory"]["blocks_in_use"] == 0                # each own home let its references go
    finally:
        await ours.aclose()


async def test_a_tool_call_re_encoded_from_its_parsed_form_is_still_read_exactly_up_to_where_it_differs():
    """The next turn renders the assistant's tool call from its parsed form; its closing braces may
    encode to other tokens than the model emitted. The run of tokens before them is exact KV of the
    agent's own, so it is read, not computed again."""
    tools = [{"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite of a module and report failures.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}}]
    ours = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    try:
        messages = [{"role": "system", "content": "You are a tester. Use the tools to check code."},
                    {"role": "user", "content": "Run the tests of module intervals and tell me what failed."}]
        call = await ours.generate(messages, agent="tester", tools=tools, tool_choice="required",
                                   sampling=SamplingParams(max_tokens=60))
        assert call.finish_reason == "tool_calls"
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in call.tool_calls]
        messages += [{"role": "assistant", "content": call.content, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "2 failed: touching, unsorted"}]
        nxt = await ours.generate(messages, agent="tester", tools=tools, tool_choice="required", sampling=FIRST)
        read = nxt.usage.cached_tokens + nxt.usage.reused_tokens
        # the previous prompt and most of the call (its re-encoded end and trailer are computed)
        assert read >= call.usage.prompt_tokens + call.usage.completion_tokens // 2
        assert nxt.usage.recomputed_tokens == 0 and "recompute" not in nxt.timings
    finally:
        await ours.aclose()
