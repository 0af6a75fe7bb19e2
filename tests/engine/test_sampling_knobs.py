"""OpenAI's sampling knobs through the real engine: penalties, logit_bias and logprobs."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from kvcmas_agents import SamplingParams
from kvcmas_agents.errors import InvalidRequestError

REPEAT = [{"role": "user", "content": "Write the word dog five times, separated by spaces."}]
LA = [{"role": "user", "content": "Say 'la la la la la la la la'."}]      # greedy repeats "la"


def test_logprobs_follow_the_tokens_and_the_logits(engine_prefix):
    plain = engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(max_tokens=8))
    out = engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(max_tokens=8, logprobs=True,
                                                                      top_logprobs=3, return_logits=True))
    assert out.token_ids == plain.token_ids and plain.logprobs is None       # asking changes nothing
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for entry, logits in zip(out.logprobs, out.logits):
        want = torch.log_softmax(logits.float(), -1)
        assert math.isclose(entry.logprob, float(want[entry.token_id]), rel_tol=1e-4, abs_tol=1e-5)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token_id == entry.token_id   # greedy
        assert entry.bytes == list(entry.token.encode()) or "\\x" in entry.token
    assert b"".join(bytes(e.bytes) for e in out.logprobs).decode() == out.text


def test_streamed_deltas_carry_the_same_logprobs(engine_prefix):
    sampling = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=1)

    async def run():
        return [d async for d in engine_prefix.stream(REPEAT, sampling=sampling)]

    deltas = asyncio.run(run())
    streamed = [e for d in deltas for e in (d.logprobs or [])]
    final = deltas[-1].output
    assert [e.token_id for e in streamed] == final.token_ids
    assert [e.logprob for e in streamed] == [e.logprob for e in final.logprobs]


def test_penalties_steer_greedy_decoding_as_openai_defines_them(engine_prefix):
    freq, pres = 1.5, 1.0
    out = engine_prefix.generate_sync(LA, sampling=SamplingParams(
        max_tokens=10, frequency_penalty=freq, presence_penalty=pres, return_logits=True))
    plain = engine_prefix.generate_sync(LA, sampling=SamplingParams(max_tokens=10))
    changed = 0
    for step, (tok, logits) in enumerate(zip(out.token_ids, out.logits)):
        counts = torch.bincount(torch.tensor(out.token_ids[:step], dtype=torch.long),
                                minlength=logits.shape[-1]).float()
        adjusted = logits.float() - counts * freq - (counts > 0).float() * pres
        assert tok == int(torch.argmax(adjusted))
        changed += tok != int(torch.argmax(logits))
    assert changed > 0 and out.token_ids != plain.token_ids      # the repeats were penalised
    repeats = lambda ids: len(ids) - len(set(ids))               # noqa: E731
    assert repeats(out.token_ids) < repeats(plain.token_ids)


def test_logit_bias_bans_and_checks_token_ids(engine_prefix):
    plain = engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(max_tokens=4))
    banned = engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(
        max_tokens=4, logit_bias={plain.token_ids[0]: -100}))
    assert banned.token_ids[0] != plain.token_ids[0]
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(logit_bias={10**7: 1}))
    with pytest.raises(InvalidRequestError, match="presence_penalty"):
        engine_prefix.generate_sync(REPEAT, sampling=SamplingParams(presence_penalty=3))
