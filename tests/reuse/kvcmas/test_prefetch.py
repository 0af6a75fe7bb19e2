"""Ahead-of-time corrections along the edge order (engine/prefetch.py) on the real default model."""
from __future__ import annotations

import pytest

from kvcmas_agents import Engine, EngineConfig, SamplingParams
from kvcmas_agents.engine import ReuseOptions
from kvcmas_agents.fidelity import CSV_SYSTEM as SYSTEM
from kvcmas_agents.fidelity import CSV_TASK as TASK
from kvcmas_agents.fidelity import kl
from kvcmas_agents import KVCMASConfig

FIRST = SamplingParams(max_tokens=1, return_logits=True)
EDGES = [("planner", "coder"), ("coder", "reviewer")]
EXACT = ReuseOptions(reuse="none")


def prompt(agent: str, history: list[dict]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM[agent]}] + history


@pytest.fixture(scope="module")
async def histories():
    """Round-1 and round-2 shared histories grown by exact greedy replies."""
    engine = Engine(EngineConfig(reuse="none"))
    history = [{"role": "user", "content": TASK}]
    rounds = []
    try:
        for note in ("Round 1.", "Round 2: improve the previous answers."):
            history.append({"role": "user", "content": note})
            snapshot = []
            for agent in SYSTEM:
                snapshot.append(list(history))
                out = await engine.generate(prompt(agent, history), agent=agent, sampling=SamplingParams(max_tokens=32))
                history.append({"role": "user", "content": f"[{agent}] {out.text}"})
            rounds.append(snapshot)      # the history each agent saw, in turn order
    finally:
        await engine.aclose()
    return rounds


async def play(engine: Engine, rounds: list[list[list[dict]]], sampling=FIRST) -> list:
    outs = []
    for snapshot in rounds:
        for agent, history in zip(SYSTEM, snapshot):
            outs.append(await engine.generate(prompt(agent, history), agent=agent, sampling=sampling))
    return outs


async def test_successors_corrections_are_computed_ahead_and_used(histories):
    plain = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    ahead = Engine(EngineConfig(reuse="kvcmas"))
    naive = Engine(EngineConfig(reuse="naive"))
    exact = Engine(EngineConfig(reuse="none"))
    try:
        for e in (plain, ahead, naive):
            e.set_edges(EDGES)
        base, pre, ref = await play(plain, histories), await play(ahead, histories), await play(exact, histories)
        floor = await play(naive, histories)
        stats = ahead.stats()["reuse"]["kvcmas"]["prefetch"]
        assert plain.stats()["reuse"]["kvcmas"]["prefetch"] is None
        # Round 2's coder and reviewer find their shared segments already corrected by the prefetch.
        assert stats["corrections"] >= 2 and stats["failed"] == 0 and stats["recomputed_tokens"] > 0
        for i in (4, 5):
            assert pre[i].usage.reused_tokens == base[i].usage.reused_tokens > 0
            assert pre[i].usage.recomputed_tokens < base[i].usage.recomputed_tokens
        # Round 1 has nothing to prefetch from (the successor's own prefix is not known yet).
        assert [o.usage.recomputed_tokens for o in pre[:3]] == [o.usage.recomputed_tokens for o in base[:3]]
        # Corrections selected before the real tail is known still beat naive reuse on those turns (the
        # harness measures the averages: README, "Results").
        ours = [kl(ref[i].logits[0], pre[i].logits[0]) for i in (3, 4, 5)]
        worst = [kl(ref[i].logits[0], floor[i].logits[0]) for i in (3, 4, 5)]
        assert sum(ours) < sum(worst) and max(ours) < 0.05, (ours, worst)
        # Prefetch requests hold no KV afterwards: only home views stay referenced, as without prefetch.
        assert ahead.stats()["memory"]["blocks_in_use"] == plain.stats()["memory"]["blocks_in_use"] > 0
    finally:
        for e in (plain, ahead, naive, exact):
            await e.aclose()


async def test_no_edges_no_prefetch(histories):
    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        await play(engine, histories[:1])
        assert engine.stats()["reuse"]["kvcmas"]["prefetch"]["queued"] == 0
    finally:
        await engine.aclose()


async def test_a_failing_prefetch_only_costs_the_optimisation(histories, monkeypatch):
    engine = Engine(EngineConfig(reuse="kvcmas"))
    engine.set_edges(EDGES)
    real = engine.methods["kvcmas"].corrector.correct

    def broken(view):
        if view.req.request_id.startswith("prefetch-"):
            raise RuntimeError("injected")
        return real(view)

    monkeypatch.setattr(engine.methods["kvcmas"].corrector, "correct", broken)
    try:
        outs = await play(engine, histories)
        stats = engine.stats()
        prefetch = stats["reuse"]["kvcmas"]["prefetch"]
        assert prefetch["failed"] >= 2 and prefetch["corrections"] == 0
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        assert outs[4].usage.recomputed_tokens > 0        # corrected inline instead
        assert stats["counters"]["failed"] == 0 and stats["counters"]["num_running"] == 0
    finally:
        await engine.aclose()


async def test_a_wrong_prediction_is_never_used(histories):
    """The successor's real prompt differs from the predicted one (other shared text): nothing matches
    the prefetched context, so its segments are corrected inline."""
    engine = Engine(EngineConfig(reuse="kvcmas"))
    engine.set_edges(EDGES)
    try:
        await play(engine, histories[:1])
        round2 = histories[1]
        await engine.generate(prompt("planner", round2[0]), agent="planner", sampling=FIRST)
        altered = [{"role": "user", "content": "A different task: sort a list."}] + round2[1][1:]
        out = await engine.generate(prompt("coder", altered), agent="coder", sampling=FIRST)
        assert out.usage.recomputed_tokens > 0
        assert engine.stats()["reuse"]["kvcmas"]["prefetch"]["corrections"] >= 1
    finally:
        await engine.aclose()


async def test_declared_agents_get_first_contact_corrections_ahead(histories):
    """With its system prompt declared, an agent's first turn finds its own prefix computed and the
    shared history corrected ahead of time by its predecessor; undeclared, round 1 corrects inline."""
    plain, declared, exact = (Engine(EngineConfig(reuse=r)) for r in ("kvcmas", "kvcmas", "none"))
    try:
        for e in (plain, declared):
            e.set_edges(EDGES)
        sizes = [declared.declare_agent(agent, SYSTEM[agent]) for agent in SYSTEM]
        stats = declared.stats()
        assert all(n > 0 for n in sizes) and stats["counters"]["declared"] == 3 and stats["counters"]["requests"] == 0
        # Only the declared prefixes' home views hold KV: the side requests freed the rest.
        assert stats["memory"]["blocks_in_use"] == len(declared.segments.home_blocks) > 0
        base, pre = await play(plain, histories[:1]), await play(declared, histories[:1])
        ref = await play(exact, histories[:1])
        assert [o.usage.cached_tokens for o in pre] == sizes and all(o.usage.cached_tokens == 0 for o in base)
        by_agent = declared.stats()["reuse"]["kvcmas"]["prefetch"]["by_agent"]
        assert by_agent.get("coder") == by_agent.get("reviewer") == 1
        for i in (1, 2):
            assert pre[i].usage.reused_tokens == base[i].usage.reused_tokens > 0
            assert pre[i].usage.recomputed_tokens < base[i].usage.recomputed_tokens
        # More rows recomputed ahead of time (prefetch_ratio) than inline: round 1 is no less faithful.
        ours = sum(kl(ref[i].logits[0], pre[i].logits[0]) for i in (1, 2))
        inline = sum(kl(ref[i].logits[0], base[i].logits[0]) for i in (1, 2))
        assert ours <= inline * 1.5 and ours < 0.05, (ours, inline)
        assert declared.stats()["counters"]["requests"] == 3 and set(declared.stats()["agents"]) == set(SYSTEM)
    finally:
        for e in (plain, declared, exact):
            await e.aclose()


async def test_declare_agent_rejects_bad_input_and_reports_failures(monkeypatch):
    from kvcmas_agents.engine import ContextLengthError, EngineError, InvalidRequestError

    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        for agent, system in (("", "hi"), ("a", ""), ("a", []), ("a", [{"role": "user", "content": "hi"}]),
                              ("a", 42)):
            with pytest.raises(InvalidRequestError):
                engine.declare_agent(agent, system)
        with pytest.raises(ContextLengthError):
            engine.declare_agent("a", "word " * (engine.max_context + 10))
        real = engine.runner.run

        def broken(items):
            if any(it.request.declare for it in items):
                raise RuntimeError("injected")
            return real(items)

        monkeypatch.setattr(engine.runner, "run", broken)
        with pytest.raises(EngineError, match="injected"):
            engine.declare_agent("planner", SYSTEM["planner"])
        out = await engine.generate(prompt("planner", [{"role": "user", "content": TASK}]), agent="planner",
                                    sampling=SamplingParams(max_tokens=4))
        stats = engine.stats()
        assert out.finish_reason in ("stop", "length") and out.usage.cached_tokens == 0
        counters = stats["counters"]
        assert counters["declare_failed"] == 1 and counters["declared"] == 0 and counters["failed"] == 0
        assert stats["counters"]["num_running"] == 0
    finally:
        await engine.aclose()
    none = Engine(EngineConfig(reuse="none"))
    try:
        assert none.declare_agent("planner", SYSTEM["planner"]) == 0 and none.stats()["counters"]["declared"] == 0
    finally:
        await none.aclose()


async def test_a_long_newest_message_selects_by_its_last_tokens_only(selection_queries):
    """A pasted document as the newest shared message: the prefetch selects rows by the attention of
    the prompt's last SELECT_MAX tokens, not of the whole document, and the successor still gets its
    correction ahead of time."""
    from kvcmas_agents.reuse.kvcmas import select

    doc = "\n".join(f"Step {i}: the service svc_{i} reads queue q{i % 7}, checks amount_{i} against "
                    f"limit {100 + 17 * i} and retries {1 + i % 3} times." for i in range(40))
    shared = [{"role": "user", "content": TASK + "\n\nDesign notes:\n" + doc}]
    # At the default prefetch_ratio (0.9) the pass would spare fewer rows than SELECT_MAX queries cost,
    # and be skipped (next test); at 0.5 it runs.
    engine = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch_ratio=0.5)}))
    exact = Engine(EngineConfig(reuse="none"))
    try:
        engine.set_edges(EDGES[:1])
        for agent in ("planner", "coder"):
            engine.declare_agent(agent, SYSTEM[agent])
        first = await engine.generate(prompt("planner", shared), agent="planner", sampling=SamplingParams(max_tokens=8))
        assert first.usage.prompt_tokens > 2 * select.SELECT_MAX
        later = shared + [{"role": "user", "content": f"[planner] {first.text}"}]
        out = await engine.generate(prompt("coder", later), agent="coder", sampling=FIRST)
        ref = await exact.generate(prompt("coder", later), agent="coder", sampling=FIRST)
        stats = engine.stats()
        assert stats["reuse"]["kvcmas"]["prefetch"]["corrections"] == stats["reuse"]["kvcmas"]["selections_capped"] == 1
        assert selection_queries[0] == select.SELECT_MAX
        assert all(q <= select.SELECT_MAX for q in selection_queries)
        # The document was corrected ahead of time: nothing of it is recomputed inline.
        assert out.usage.reused_tokens > first.usage.prompt_tokens // 2
        assert out.usage.recomputed_tokens < len(first.token_ids) + 32
        assert kl(ref.logits[0], out.logits[0]) < 0.05
    finally:
        for e in (engine, exact):
            await e.aclose()


async def test_a_prefetch_that_would_spare_few_rows_recomputes_them_all_without_a_selection_pass(
        histories, selection_queries):
    """Round 2's prefetches correct a short new segment at prefetch_ratio 0.9 with stand-in queries
    reaching back over the newest known message: the selection pass would cost more queries than the
    rows it spares, so every pending row is recomputed and no pass runs for them."""
    from kvcmas_agents.reuse.kvcmas import select

    ranked = []
    real_mass = select.attention_mass

    def spy(view, pending):
        ranked.append(view.select_from is not None)     # True: an ahead-of-time correction's pass
        return real_mass(view, pending)

    engine, exact = Engine(EngineConfig(reuse="kvcmas")), Engine(EngineConfig(reuse="none"))
    try:
        engine.set_edges(EDGES)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(select, "attention_mass", spy)
            outs = await play(engine, histories)
        ref = await play(exact, histories)
        stats = engine.stats()["reuse"]["kvcmas"]
        assert stats["prefetch"]["corrections"] >= 2 and stats["prefetch"]["failed"] == 0
        assert stats["selections_skipped"] >= stats["prefetch"]["corrections"]
        assert not any(ranked)                    # no ahead-of-time correction ran a pass
        assert len(selection_queries) == len(ranked)
        for i in (4, 5):                          # the prefetched turns: nothing left to correct inline
            assert outs[i].usage.reused_tokens > 0
            assert kl(ref[i].logits[0], outs[i].logits[0]) < 0.01
    finally:
        for e in (engine, exact):
            await e.aclose()


async def test_idle_prefetch_waits_for_an_idle_engine_and_yields_to_the_real_request(histories):
    """prefetch="idle": ahead-of-time work never runs between a request's decode steps; it runs once
    nothing runs, and a successor whose request arrives first drops it and corrects inline."""
    import asyncio

    engine = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch="idle")}))
    engine.set_edges(EDGES)
    try:
        planner, coder = list(SYSTEM)[:2]
        await engine.generate(prompt(coder, histories[0][1]), agent=coder, sampling=FIRST)   # coder's prefix known
        # The planner decodes 16 tokens: its successor's prefetch is queued but waits for the engine to idle.
        await engine.generate(prompt(planner, histories[1][0]), agent=planner,
                              sampling=SamplingParams(max_tokens=16, ignore_eos=True))
        pf = engine.stats()["reuse"]["kvcmas"]["prefetch"]
        assert pf["queued"] >= 1 and pf["corrections"] == 0
        for _ in range(200):                  # idle now: it runs
            pf = engine.stats()["reuse"]["kvcmas"]["prefetch"]
            if pf["corrections"]:
                break
            await asyncio.sleep(0.05)
        assert pf["corrections"] == 1
        # A successor that arrives while its prefetch is still queued (its predecessor still decodes)
        # drops it and corrects inline.
        engine.set_edges([("planner2", coder)])
        before = dict(engine.stats()["reuse"]["kvcmas"]["prefetch"])
        lead = asyncio.ensure_future(engine.generate(prompt(planner, histories[1][1]), agent="planner2",
                                                     sampling=SamplingParams(max_tokens=48, ignore_eos=True)))
        for _ in range(400):
            if engine.stats()["reuse"]["kvcmas"]["prefetch"]["queued"] > before["queued"]:
                break
            await asyncio.sleep(0.01)
        out = await engine.generate(prompt(coder, histories[1][1]), agent=coder, sampling=FIRST)
        await lead
        after = engine.stats()["reuse"]["kvcmas"]["prefetch"]
        assert after["queued"] == before["queued"] + 1 and after["skipped"] == before["skipped"] + 1
        assert after["corrections"] == before["corrections"] and out.usage.recomputed_tokens > 0
        assert engine.stats()["counters"]["failed"] == 0
    finally:
        await engine.aclose()


def test_prefetch_modes_are_checked():
    assert KVCMASConfig(prefetch=True).prefetch == "decode" and KVCMASConfig(prefetch=False).prefetch == "off"
    with pytest.raises(ValueError, match="prefetch"):
        KVCMASConfig(prefetch="always")
