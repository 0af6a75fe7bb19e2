"""The CacheBlend and KVCOMM baselines on the real default model: what they reuse, recompute and hold."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from kvcmas_agents import Engine, EngineConfig, SamplingParams
from kvcmas_agents.engine import ReuseOptions
from kvcmas_agents.reuse.baselines.anchors import Anchor, AnchorPool, distance, fit
from kvcmas_agents.fidelity import CSV_SYSTEM as SYSTEM
from kvcmas_agents.fidelity import CSV_TASK as TASK
from kvcmas_agents.fidelity import kl
from kvcmas_agents.reuse.baselines import CacheBlendConfig, KVCommConfig

FIRST = SamplingParams(max_tokens=1, return_logits=True)
PLAN = ("[planner] 1. Open the file with csv.reader. 2. Skip malformed rows and missing amounts. "
        "3. Sum the amounts per region in a dict. 4. Sort the totals descending and return them.")
CODE = ("[coder] def totals(path):\n    out = {}\n    with open(path) as f:\n        for row in csv.reader(f):\n"
        "            try:\n                out[row[1]] = out.get(row[1], 0) + float(row[2])\n"
        "            except (IndexError, ValueError):\n                continue\n"
        "    return sorted(out.items(), key=lambda kv: -kv[1])")
HISTORY = [{"role": "user", "content": TASK}, {"role": "user", "content": PLAN},
           {"role": "user", "content": CODE}]


@pytest.fixture
def engine():
    eng = Engine(EngineConfig(reuse="none"))     # each test starts with empty homes and anchors
    yield eng
    eng.close()


def prompt(agent: str, turn: int, history: list[dict] = HISTORY) -> list[dict]:
    """Agent's prompt at pipeline turn 0 (planner), 1 (coder) or 2 (reviewer): sees the first turn+1 messages."""
    return [{"role": "system", "content": SYSTEM[agent]}] + history[:turn + 1]


async def run(engine: Engine, agent: str, messages: list[dict], mode: str, name: str | None = None, **knobs):
    return await engine.generate(messages, agent=name or agent, sampling=FIRST,
                                 reuse_options=ReuseOptions(reuse=mode, **knobs))


async def exact(engine: Engine, messages: list[dict]):
    return await engine.generate(messages, agent="exact", sampling=FIRST, reuse_options=ReuseOptions(reuse="none"))


async def settle(engine: Engine) -> dict:
    while engine.scheduler.has_work():
        await asyncio.sleep(0.01)
    return engine.stats()


async def peak_extra(engine: Engine, agent: str, messages: list[dict], mode: str, name: str):
    """KV block bytes and total KV bytes (blocks + corrections + anchors) a request adds at its peak."""
    await settle(engine)
    engine.reset_peak()
    before = engine.stats()
    out = await run(engine, agent, messages, mode, name)
    after = engine.stats()
    a, b = after["memory"], before["memory"]
    return out, a["kv_bytes_peak"] - b["kv_bytes"], a["total_bytes_peak"] - b["total_bytes"]


async def test_cacheblend_pipeline(engine):
    await run(engine, "planner", prompt("planner", 0), "cacheblend")
    for turn, agent in ((1, "coder"), (2, "reviewer")):
        msgs = prompt(agent, turn)
        ref = await exact(engine, msgs)
        out = await run(engine, agent, msgs, "cacheblend")
        assert out.reuse == "cacheblend" and out.usage.reused_tokens > 0
        # CacheBlend's default: the top 15% of reused tokens by layer-1 KV deviation.
        assert out.usage.recomputed_tokens == round(0.15 * out.usage.reused_tokens)
        u = out.usage     # the recomputed tokens are among the reused ones; their stored KV was not kept
        assert u.kept_tokens == u.cached_tokens + u.reused_tokens - u.recomputed_tokens
        assert math.isfinite(kl(ref.logits[0], out.logits[0]))
    stats = await settle(engine)
    # Nothing persists: no corrections or anchors; KV is back to the home views (+ cached blocks).
    kvcmas, kvcomm = stats["reuse"]["kvcmas"], stats["reuse"]["kvcomm"]
    assert kvcmas["corrections"] == 0 and kvcmas["correction_bytes"] == 0 and kvcomm["anchor_bytes"] == 0
    assert stats["memory"]["blocks_in_use"] == len(engine.segments.home_blocks)
    assert stats["memory"]["kv_bytes"] == stats["memory"]["home_view_bytes"] + stats["memory"]["kv_bytes_cached"]
    assert stats["reuse"]["cacheblend"]["ratio"] == 0.15
    assert len(engine.methods["cacheblend"].states) == 0        # each request's state went with it


async def test_cacheblend_holds_a_private_copy(engine):
    msgs = prompt("reviewer", 2)
    for agent, turn in (("planner", 0), ("coder", 1), ("reviewer", 2)):
        await run(engine, agent, prompt(agent, turn), "kvcmas")
    # Same homes for both: the reviewer's system prompt and every history message are home views now.
    blend, blend_extra, blend_total = await peak_extra(engine, "reviewer", msgs, "cacheblend", "r-blend")
    ours, ours_extra, ours_total = await peak_extra(engine, "reviewer", msgs, "kvcmas", "r-kvcmas")
    naive, naive_extra, _ = await peak_extra(engine, "reviewer", msgs, "naive", "r-naive")
    assert blend.usage.reused_tokens == ours.usage.reused_tokens == naive.usage.reused_tokens > 0
    bs, block = engine.store.block_size, engine.stats()["memory"]["block_bytes"]
    full_copy = (blend.usage.reused_tokens // bs - 1) * block      # blocks wholly inside the reused spans
    assert blend_extra - ours_extra >= full_copy > 0
    assert blend_extra - naive_extra >= full_copy
    assert blend_total > ours_total          # the private copy outweighs KVCMAS's blocks + correction
    assert blend_total >= blend_extra
    stats = await settle(engine)
    assert stats["memory"]["blocks_in_use"] == len(engine.segments.home_blocks)


async def test_cacheblend_full_ratio_is_exact(engine):
    await run(engine, "planner", prompt("planner", 0), "cacheblend")
    await run(engine, "coder", prompt("coder", 1), "cacheblend")
    msgs = prompt("reviewer", 2)
    ref = await exact(engine, msgs)
    full = await run(engine, "reviewer", msgs, "cacheblend", "r-full", recompute_ratio=1.0)
    part = await run(engine, "reviewer", msgs, "cacheblend", "r-part")
    none = await run(engine, "reviewer", msgs, "cacheblend", "r-none", recompute_ratio=0.0)
    assert full.usage.recomputed_tokens == full.usage.reused_tokens > 0
    assert none.usage.recomputed_tokens == 0
    assert kl(ref.logits[0], full.logits[0]) < 1e-4
    # Recomputing more cannot be worse than the realigned copy alone (naive reuse) on this prompt.
    assert kl(ref.logits[0], part.logits[0]) <= kl(ref.logits[0], none.logits[0]) + 1e-6


async def test_kvcomm_anchors(engine):
    await run(engine, "planner", prompt("planner", 0), "kvcomm")
    msgs = prompt("coder", 1)
    task_len = engine.formatter.render(msgs).segments[1].length
    ref = await exact(engine, msgs)
    first = await run(engine, "coder", msgs, "kvcomm")
    # First encounter of (coder, message 1): dense prefill, which becomes an anchor.
    assert first.usage.recomputed_tokens == task_len and first.usage.reused_tokens == 0
    assert first.usage.kept_tokens == first.usage.cached_tokens      # the dense prefill is not among reused
    stats = engine.stats()
    kvcomm = stats["reuse"]["kvcomm"]
    assert kvcomm["anchors"] == 1 and kvcomm["misses"] == 1 and kvcomm["anchor_bytes"] > 0
    assert stats["reuse"]["kvcomm"]["anchor_bytes_by_agent"] == {"coder": stats["reuse"]["kvcomm"]["anchor_bytes"]}
    assert stats["memory"]["state_bytes"] == stats["reuse"]["kvcmas"]["correction_bytes"] + kvcomm["anchor_bytes"]
    assert stats["memory"]["total_bytes"] == stats["memory"]["kv_bytes"] + stats["memory"]["state_bytes"]
    layers, heads, dim = engine.args.num_layers, engine.args.num_kv_heads, engine.args.head_dim
    elem = engine.store.k.element_size()
    assert kvcomm["anchor_bytes"] == (2 * layers + 1) * task_len * heads * dim * elem   # full offsets + base keys
    assert kl(ref.logits[0], first.logits[0]) < 1e-4                                      # dense = exact

    again = await run(engine, "coder", msgs, "kvcomm")       # same segment: served from the anchor
    assert again.usage.reused_tokens == task_len and again.usage.recomputed_tokens == 0
    assert engine.stats()["reuse"]["kvcomm"]["hits"] == 1 and engine.stats()["reuse"]["kvcomm"]["anchors"] == 1
    assert kl(ref.logits[0], again.logits[0]) < 1e-4

    rev = await run(engine, "reviewer", prompt("reviewer", 2), "kvcomm")
    assert rev.usage.reused_tokens == 0 and rev.usage.recomputed_tokens > task_len   # two new placeholders
    assert engine.stats()["reuse"]["kvcomm"]["anchors"] == 3

    # A later conversation with a similar task: the coder's anchor for message 1 serves it.
    similar = [{"role": "user", "content": TASK.replace("descending", "ascending")}]
    await run(engine, "planner", prompt("planner", 0, similar), "kvcomm")
    ref2 = await exact(engine, prompt("coder", 0, similar))
    hits = engine.stats()["reuse"]["kvcomm"]["hits"]
    out = await run(engine, "coder", prompt("coder", 0, similar), "kvcomm")
    assert out.usage.reused_tokens == engine.formatter.render(prompt("coder", 0, similar)).segments[1].length
    assert out.usage.recomputed_tokens == 0
    assert engine.stats()["reuse"]["kvcomm"]["hits"] == hits + 1
    assert kl(ref2.logits[0], out.logits[0]) < 0.05

    # An unrelated task is not similar enough: dense prefill and a second anchor for (coder, 1).
    other = [{"role": "user", "content": "Explain how a hash map resolves collisions, with a short example."}]
    await run(engine, "planner", prompt("planner", 0, other), "kvcomm")
    far = await run(engine, "coder", prompt("coder", 0, other), "kvcomm")
    assert far.usage.recomputed_tokens > 0 and far.usage.reused_tokens == 0
    assert len(engine.methods["kvcomm"].pool._pools[("coder", 1)]) == 2
    stats = await settle(engine)
    assert stats["memory"]["blocks_in_use"] == len(engine.segments.home_blocks)   # copies freed
    assert stats["memory"]["total_bytes"] == stats["memory"]["kv_bytes"] + stats["reuse"]["kvcomm"]["anchor_bytes"]


def test_anchor_pool_matches_interpolates_and_evicts():
    torch.manual_seed(0)
    pool = AnchorPool(max_per_placeholder=2, threshold=0.25)
    base = torch.randn(4, 1, 2)

    def mk(b: torch.Tensor, off: float) -> Anchor:
        return Anchor("a", 1, b, torch.full((2, b.shape[0], 1, 2), off), torch.full((2, b.shape[0], 1, 2), off))

    assert pool.match("a", 1, base) is None                     # empty pool: a miss
    pool.add(mk(base, 1.0))
    pool.add(mk(base + 0.01, 3.0))
    m = pool.match("a", 1, base)
    assert m is not None and m.distance == 0.0 and len(m.anchors) == 2
    assert m.weights[0] > m.weights[1] and torch.isclose(m.weights.sum(), torch.tensor(1.0))
    dk, _ = pool.offsets(m, 6)                                   # interpolated, padded to 6 tokens
    assert dk.shape == (2, 6, 1, 2) and (dk[:, 4:] == 0).all() and 1.0 < dk[0, 0, 0, 0] < 3.0
    assert pool.match("a", 1, torch.randn(4, 1, 2) * 5) is None  # far: a miss
    assert pool.match("b", 1, base) is None                      # per agent
    pool.add(mk(base, 5.0))                                      # third anchor: the oldest is evicted
    assert pool.stats().anchors == 2 and pool.evicted == 1
    assert pool.stats().anchor_bytes == pool.nbytes == 2 * (8 + 2 * 16) * 4
    assert distance(base, base[:2]) == pytest.approx(0.5)        # uncovered tokens count as fully different
    assert fit(torch.ones(2, 3, 1), 2).shape == (2, 2, 1)


def test_baseline_knobs_are_checked():
    with pytest.raises(ValueError, match="reuse must be one of"):
        ReuseOptions(reuse="blend").validate()
    for bad in (CacheBlendConfig(0.5), KVCommConfig(anchors=3)):
        with pytest.raises(ValueError, match="must be a"):          # another method's settings
            EngineConfig(methods={"cacheblend" if isinstance(bad, KVCommConfig) else "kvcomm": bad})
    with pytest.raises(ValueError, match="reuse must be one of"):
        EngineConfig(methods={"blend": CacheBlendConfig()})
    for make, field in ((lambda: CacheBlendConfig(ratio=1.5), "ratio"), (lambda: KVCommConfig(anchors=0), "anchors"),
                        (lambda: KVCommConfig(anchors=2.5), "anchors"), (lambda: KVCommConfig(threshold=0.0),
                                                                         "threshold")):
        with pytest.raises(ValueError, match=field):
            make()
    cfg = EngineConfig(reuse="cacheblend", methods={"cacheblend": CacheBlendConfig(ratio=0.2)})
    assert ReuseOptions().resolve(cfg).recompute_ratio == 0.2
    assert ReuseOptions(recompute_ratio=0.4).resolve(cfg).recompute_ratio == 0.4
    assert ReuseOptions(reuse="kvcmas").resolve(cfg).recompute_ratio == cfg.kvcmas.recompute_ratio
    assert ReuseOptions().resolve(EngineConfig(reuse="cacheblend")).recompute_ratio == 0.15

def test_anchor_pool_drops_its_oldest_anchor_when_the_budget_needs_room():
    pool = AnchorPool(max_per_placeholder=4, threshold=0.25)

    def anchor(placeholder: int) -> Anchor:
        return Anchor("a", placeholder, torch.zeros(3, 1, 2), torch.zeros(2, 3, 1, 2), torch.zeros(2, 3, 1, 2))

    first, second, other = anchor(1), anchor(1), anchor(2)
    for a in (first, second, other):
        pool.add(a)
    full = pool.nbytes
    assert pool.drop_oldest() and pool.nbytes == full - first.nbytes
    assert pool.drop_oldest() and pool.drop_oldest() and pool.nbytes == 0
    assert not pool.drop_oldest() and pool.evicted == 3
