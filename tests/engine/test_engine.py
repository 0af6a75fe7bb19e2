"""End-to-end engine behaviour on the real default model (no mocks of the model)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvcmas_agents import EngineClosedError, EngineError, InvalidRequestError, SamplingParams
from kvcmas_agents.errors import ContextLengthError
from kvcmas_agents import KVCMASConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "system", "content": "You are a terse code reviewer."},
     {"role": "user", "content": "Review: def f(x): return x*2"}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy?"}],
]


@pytest.fixture(scope="module")
def hf_model(engine_none):
    from kvcmas_agents.model.loader import ensure_safetensors
    _, path = ensure_safetensors(None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("messages", PROMPTS)
async def test_greedy_matches_transformers_generate(engine_none, hf_model, messages):
    sampling = SamplingParams(max_tokens=24, temperature=0.0, return_logits=True)
    out = await engine_none.generate(messages, agent="a", sampling=sampling)
    ids = engine_none.formatter.render(messages).token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        ref_logits = hf_model(torch.tensor([ids])).logits[0, -1]
    assert out.token_ids == ref[:len(out.token_ids)]
    if out.finish_reason == "stop":
        assert ref[len(out.token_ids)] in engine_none.stop_token_ids
    else:
        assert len(out.token_ids) == 24
    assert torch.allclose(out.logits[0], ref_logits, atol=1e-3, rtol=1e-4)


async def test_int8_rows_move_the_logits_by_their_rounding_not_the_tokens(engine_none):
    """``weights="int8"`` (decode rows rounded to int8 a block, as llama.cpp does) gives the default's
    greedy tokens on a short reply; its first logits differ by the rounding (the last position's
    vocabulary product is a decode-sized one)."""
    from kvcmas_agents import Engine, EngineConfig

    engine = Engine(EngineConfig(reuse="none", weights="int8"))
    try:
        assert "int8 rows" in engine.stats()["engine"]["weights"]
        sampling = SamplingParams(max_tokens=16, temperature=0.0, return_logits=True)
        fast = await engine.generate(PROMPTS[2], agent="a", sampling=sampling)
        exact = await engine_none.generate(PROMPTS[2], agent="a", sampling=sampling)
    finally:
        await engine.aclose()
    assert fast.token_ids == exact.token_ids
    spread = exact.logits[0].max() - exact.logits[0].min()
    assert 0 < (fast.logits[0] - exact.logits[0]).abs().max() < 0.1 * spread


async def test_prefix_reuse_second_turn_matches_exact(engine_none, engine_prefix):
    first = [{"role": "system", "content": "You are a planner for a small software team."},
             {"role": "user", "content": "Plan a command-line todo app in Python."}]
    out1 = await engine_prefix.generate(first, agent="planner", sampling=GREEDY)
    assert out1.usage.cached_tokens == 0
    second = first + [{"role": "assistant", "content": out1.text},
                      {"role": "user", "content": "Now list the files the project needs."}]
    out2 = await engine_prefix.generate(second, agent="planner", sampling=GREEDY)
    exact = await engine_none.generate(second, agent="planner", sampling=GREEDY)
    assert out2.usage.cached_tokens > 0
    assert out2.usage.cached_tokens % engine_prefix.store.block_size == 0
    assert out2.usage.cached_tokens < out2.usage.prompt_tokens
    assert exact.usage.cached_tokens == 0
    assert out2.token_ids == exact.token_ids
    # Per-agent caching: another agent with the same prompt gets no hit.
    other = await engine_prefix.generate(second, agent="coder", sampling=GREEDY)
    assert other.usage.cached_tokens == 0
    assert engine_prefix.stats()["agents"]["planner"]["cached_tokens"] >= out2.usage.cached_tokens


async def test_concurrent_requests_equal_sequential(engine_prefix):
    reqs = [([{"role": "system", "content": f"You are agent number {i}."},
              {"role": "user",
               "content": f"Give one tip about topic {i}: {'testing caching naming loops errors types docs speed'.split()[i]}."}],
             f"agent{i}") for i in range(8)]
    sampling = SamplingParams(max_tokens=20, temperature=0.0)
    steps_before = engine_prefix.stats()["counters"]["steps"]
    concurrent = await asyncio.gather(*[engine_prefix.generate(m, agent=a, sampling=sampling) for m, a in reqs])
    stats = engine_prefix.stats()
    assert stats["counters"]["max_batch_seqs"] >= 2          # they really shared steps
    concurrent_steps = stats["counters"]["steps"] - steps_before
    sequential = [await engine_prefix.generate(m, agent=a + "-seq", sampling=sampling) for m, a in reqs]
    assert [o.token_ids for o in concurrent] == [o.token_ids for o in sequential]
    assert concurrent_steps < sum(len(o.token_ids) + 1 for o in sequential)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "wizard", "content": "hi"}], "role"),
    ([{"role": "user", "content": 42}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "multimodal"),
    ("hello", "list"),
])
async def test_bad_messages_raise_before_work(engine_prefix, messages, match):
    before = engine_prefix.stats()["counters"]["requests"]
    with pytest.raises(InvalidRequestError, match=match):
        await engine_prefix.generate(messages, agent="bad")
    assert engine_prefix.stats()["counters"]["requests"] == before


async def test_bad_sampling_and_context(engine_prefix):
    msgs = [{"role": "user", "content": "hi"}]
    for bad in (SamplingParams(max_tokens=0), SamplingParams(max_tokens=-3), SamplingParams(top_p=0.0)):
        with pytest.raises(ValueError):
            await engine_prefix.generate(msgs, sampling=bad)
    with pytest.raises(ContextLengthError, match="context window"):
        await engine_prefix.generate([{"role": "user", "content": "word " * (engine_prefix.max_context + 10)}])
    with pytest.raises(InvalidRequestError, match="agent"):
        await engine_prefix.generate(msgs, agent="")


async def test_cancel_mid_decode_frees_blocks_and_others_finish(engine_none):
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    msgs = [{"role": "user", "content": "Tell me a long story about a robot."}]
    started = asyncio.Event()

    async def victim():
        n = 0
        async for _ in engine_none.stream(msgs, agent="victim", sampling=long):
            n += 1
            if n == 3:
                started.set()

    task = asyncio.create_task(victim())
    others = [asyncio.create_task(engine_none.generate(msgs, agent=f"o{i}", sampling=SamplingParams(max_tokens=30)))
              for i in range(2)]
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    outs = await asyncio.gather(*others)
    assert all(o.usage.completion_tokens > 0 for o in outs)
    await _wait_idle(engine_none)
    stats = engine_none.stats()
    assert stats["counters"]["aborted"] >= 1
    assert stats["memory"]["blocks_in_use"] == 0 and stats["memory"]["kv_bytes"] == 0   # reuse="none" caches nothing


async def test_engine_exception_fails_only_affected_request(engine_none, monkeypatch):
    real_run = engine_none.runner.run

    def flaky_run(items):
        if any(it.request.request_id == "poison" for it in items):
            raise RuntimeError("injected kernel failure")
        return real_run(items)

    monkeypatch.setattr(engine_none.runner, "run", flaky_run)
    msgs = [{"role": "user", "content": "Say hello."}]
    results = await asyncio.gather(
        engine_none.generate(msgs, agent="x", sampling=GREEDY, request_id="poison"),
        engine_none.generate(msgs, agent="y", sampling=GREEDY),
        engine_none.generate(msgs, agent="z", sampling=GREEDY),
        return_exceptions=True)
    assert isinstance(results[0], EngineError) and "injected" in str(results[0])
    assert results[1].token_ids == results[2].token_ids and results[1].token_ids
    monkeypatch.setattr(engine_none.runner, "run", real_run)
    again = await engine_none.generate(msgs, agent="x", sampling=GREEDY)
    assert again.token_ids == results[1].token_ids
    await _wait_idle(engine_none)
    assert engine_none.stats()["memory"]["blocks_in_use"] == 0


async def test_kv_returns_to_cached_baseline(engine_prefix):
    msgs = [{"role": "system", "content": "You are a tester."}, {"role": "user", "content": "Write a unit test."}]
    await asyncio.gather(*[engine_prefix.generate(msgs, agent=f"t{i}", sampling=GREEDY) for i in range(3)])
    await _wait_idle(engine_prefix)
    s = engine_prefix.stats()
    assert s["memory"]["blocks_in_use"] == 0
    assert s["memory"]["kv_bytes"] == s["memory"]["kv_bytes_cached"] > 0
    assert s["memory"]["kv_bytes_peak"] >= s["memory"]["kv_bytes"]


async def test_stream_concatenates_to_final_text(engine_prefix):
    msgs = [{"role": "user", "content": "List three fruits."}]
    parts, final = [], None
    async for delta in engine_prefix.stream(msgs, agent="s", sampling=SamplingParams(max_tokens=30)):
        parts.append(delta.text)
        final = delta
    assert final.finish_reason in ("stop", "length") and final.output is not None
    assert "".join(parts) == final.output.text


async def test_stop_strings_and_seeded_sampling(engine_prefix):
    msgs = [{"role": "user", "content": "Count from 1 to 10 separated by commas."}]
    full = await engine_prefix.generate(msgs, sampling=SamplingParams(max_tokens=40))
    assert "4" in full.text
    cut = await engine_prefix.generate(msgs, sampling=SamplingParams(max_tokens=40, stop=["4"]))
    assert cut.finish_reason == "stop" and cut.stop_reason == "4"
    assert "4" not in cut.text and full.text.startswith(cut.text)
    hot = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    a, b = await asyncio.gather(engine_prefix.generate(msgs, sampling=hot), engine_prefix.generate(msgs, sampling=hot))
    assert a.token_ids == b.token_ids


def test_generate_sync_from_threads(engine_prefix):
    msgs = [{"role": "user", "content": "Name a color."}]
    results: list = [None] * 3

    def work(i):
        results[i] = engine_prefix.generate_sync(msgs, agent=f"thread{i}", sampling=SamplingParams(max_tokens=8))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None and r.usage.completion_tokens > 0 for r in results)
    assert len({tuple(r.token_ids) for r in results}) == 1


async def test_closed_engine_rejects_requests():
    from kvcmas_agents import Engine, EngineConfig
    engine = Engine(EngineConfig(reuse="prefix", kv_budget_bytes=64 * 1024**2))
    pending = asyncio.create_task(engine.generate([{"role": "user", "content": "Write a poem."}],
                                                  sampling=SamplingParams(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.3)
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await pending
    with pytest.raises(EngineClosedError):
        await engine.generate([{"role": "user", "content": "hi"}])


async def test_request_larger_than_kv_budget_is_refused():
    from kvcmas_agents import Engine, EngineConfig
    engine = Engine(EngineConfig(reuse="none", kv_budget_bytes=4 * 1024**2))   # 5 blocks of 16 tokens
    try:
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            await engine.generate([{"role": "user", "content": "hello " * 100}], sampling=SamplingParams(max_tokens=10))
    finally:
        await engine.aclose()


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    """Aborts are applied by the worker asynchronously; wait until it has no work left."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while engine.scheduler.has_work() and loop.time() < end:
        await asyncio.sleep(0.02)


async def test_a_corrected_request_starts_before_the_next_correction_runs():
    """Corrections run one per engine step: of two concurrent requests that both need one, the first
    corrected samples its first token before the second's correction starts, instead of waiting for it."""
    from kvcmas_agents import Engine, EngineConfig
    task = {"role": "user", "content": "Write a Python function that merges overlapping intervals, with tests."}
    eng = Engine(EngineConfig(reuse="kvcmas", methods={"kvcmas": KVCMASConfig(prefetch=False)}))
    events: list[tuple[str, str]] = []
    correct, run = eng.methods["kvcmas"].corrector.correct, eng.runner.run

    def logged_correct(view):
        events.append(("correct", view.req.agent))
        return correct(view)

    def logged_run(items):
        events.extend(("first token", it.request.agent) for it in items if it.samples and not it.request.output_ids)
        return run(items)

    eng.methods["kvcmas"].corrector.correct, eng.runner.run = logged_correct, logged_run
    try:
        await eng.generate([{"role": "system", "content": "You are the planner."}, task], agent="planner",
                           sampling=SamplingParams(max_tokens=2))
        events.clear()
        outs = await asyncio.gather(*(eng.generate([{"role": "system", "content": f"You are the {a}."}, task],
                                                   agent=a, sampling=SamplingParams(max_tokens=4))
                                      for a in ("coder", "reviewer")))
    finally:
        await eng.aclose()
    assert all(o.usage.reused_tokens > 0 for o in outs)
    corrections = [agent for kind, agent in events if kind == "correct"]
    assert sorted(corrections) == ["coder", "reviewer"]
    first, second = corrections
    assert events.index(("first token", first)) < events.index(("correct", second))


async def test_the_worker_builds_the_engine_with_its_own_thread_count():
    """The model is built on the worker, which runs its torch ops with EngineConfig.num_threads (here 1),
    whatever the calling thread uses; build errors still reach the caller."""
    from kvcmas_agents import Engine, EngineConfig
    from kvcmas_agents.errors import ModelNotFoundError
    caller = torch.get_num_threads()
    engine = Engine(EngineConfig(model=None, device="cpu", reuse="prefix", num_threads=1))
    try:
        assert engine.stats()["engine"]["num_threads"] == 1
        assert torch.get_num_threads() == caller
        out = await engine.generate(PROMPTS[0], agent="a", sampling=SamplingParams(max_tokens=4))
        assert out.usage.completion_tokens == 4
    finally:
        await engine.aclose()
    with pytest.raises(ModelNotFoundError):
        Engine(EngineConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu"))
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)
