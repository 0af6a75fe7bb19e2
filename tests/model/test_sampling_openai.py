"""OpenAI's sampling knobs in the batched sampler: frequency/presence penalties, logit_bias, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvcmas_agents.engine.config import SamplingParams
from kvcmas_agents.errors import InvalidRequestError
from kvcmas_agents.model.sampling import Sampler, make_generator

VOCAB = 64


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(row: list[float], history: list[int], freq: float, pres: float, bias: dict) -> list[float]:
    """OpenAI's formula, written out token by token."""
    out = []
    for j, logit in enumerate(row):
        c = history.count(j)
        out.append(logit - c * freq - (1.0 if c > 0 else 0.0) * pres + bias.get(j, 0.0))
    return out


def test_penalties_and_bias_follow_openais_formula_in_greedy_rows():
    sampler = Sampler()
    logits = _logits(6, seed=1)
    top = torch.argmax(logits, dim=-1).tolist()
    # Each row's history repeats its own argmax, so the penalties decide between it and the rest.
    cases = [(0.0, 0.0, {}), (1.5, 0.0, {}), (0.0, 2.0, {}), (2.0, 2.0, {}), (-2.0, -2.0, {}),
             (0.0, 0.0, {7: 100.0})]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p, logit_bias=b or None) for f, p, b in cases]
    histories = [[t, t, t, 5] for t in top]
    before = logits.clone()
    out = sampler(logits, params, [None] * 6, None, histories).tolist()
    assert torch.equal(logits, before)                     # the caller's logits are never written
    for i, (f, p, b) in enumerate(cases):
        ref = _reference(logits[i].tolist(), histories[i], f, p, b)
        assert out[i] == max(range(VOCAB), key=ref.__getitem__)
    assert out[0] == top[0] and out[5] == 7
    assert out[3] != top[3]                                # -3*2-2 on the repeated argmax


def test_rows_without_the_knobs_are_untouched_in_a_mixed_batch():
    sampler = Sampler()
    logits = _logits(3, seed=2)
    params = [SamplingParams(), SamplingParams(logit_bias={0: -100.0, 1: 50.0}), SamplingParams(temperature=0.9, seed=4)]
    out = sampler(logits, params, [None, None, make_generator(4, "cpu")], None, [[], [], []])
    plain = sampler(logits, [SamplingParams(), SamplingParams(), params[2]], [None, None, make_generator(4, "cpu")])
    assert out[0] == plain[0] and out[2] == plain[2] and out[1] == 1


def test_a_banned_token_is_never_sampled():
    sampler = Sampler()
    logits = torch.zeros(1, 4)
    p = [SamplingParams(temperature=1.0, logit_bias={0: -100.0, 2: -100.0})]
    seen = {int(sampler(logits, p, [make_generator(s, "cpu")])[0]) for s in range(60)}
    assert seen == {1, 3}


def test_logprobs_are_log_softmax_of_the_processed_logits():
    sampler = Sampler()
    logits = _logits(3, seed=3)
    params = [SamplingParams(logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0.5, seed=1, logprobs=True, logit_bias={9: 5.0}),
              SamplingParams()]
    gens = [None, make_generator(1, "cpu"), None]
    res = sampler.sample(logits, params, gens, None, [[], [], []])
    greedy = res.logprobs.get(0)
    want = torch.log_softmax(logits[0], -1)
    assert greedy.token_id == int(res.tokens[0]) == int(torch.argmax(logits[0]))
    assert math.isclose(greedy.logprob, float(want[greedy.token_id]), rel_tol=1e-5)
    assert [t for t, _ in greedy.top] == torch.topk(want, 5).indices.tolist()
    assert all(a >= b for (_, a), (_, b) in zip(greedy.top, greedy.top[1:]))
    sampled = res.logprobs.get(1)
    biased = logits[1].clone()
    biased[9] += 5.0
    want = torch.log_softmax(biased / 0.5, -1)
    assert sampled.token_id == int(res.tokens[1]) and sampled.top == []
    assert math.isclose(sampled.logprob, float(want[sampled.token_id]), rel_tol=1e-5)
    assert res.logprobs.get(2) is None
    forced = res.logprobs.get(0, token=3)                  # teacher forcing asks for another token's
    assert forced.token_id == 3 and math.isclose(forced.logprob, float(torch.log_softmax(logits[0], -1)[3]),
                                                 rel_tol=1e-5)
    assert sampler.sample(logits, [SamplingParams()] * 3, [None] * 3).logprobs is None


@pytest.mark.parametrize("kwargs", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -2.01}, {"frequency_penalty": float("nan")},
    {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": {i: 1 for i in range(301)}},
    {"logit_bias": {"x": 1}}, {"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2},
    {"logprobs": "yes"},
])
def test_out_of_range_settings_are_invalid_requests(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs).validate()


def test_json_style_logit_bias_keys_and_vocab_check():
    p = SamplingParams(logit_bias={"12": -5, 3: 100})
    p.validate()
    assert p.logit_bias == {12: -5, 3: 100}
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        p.check_vocab(10)
