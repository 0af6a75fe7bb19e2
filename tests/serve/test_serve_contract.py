"""OpenAI's contract through the live gateway and the real openai client: penalties, logit_bias, logprobs
(streamed and not), any ``user`` string, unknown models, unsupported fields."""
from __future__ import annotations

import math

import openai
import pytest

from serve_gateway import API_KEY, MODEL  # type: ignore[import-not-found]

ASK = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)


def test_logprobs_in_openais_shape_streamed_and_not(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    total = sum(math.exp(t.logprob) for t in content[0].top_logprobs)
    assert 0 < total <= 1.0 + 1e-6
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_penalties_and_logit_bias_reach_the_sampler(client, gateway):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    (first_id,) = gateway.engine.tokenize(first.token)
    banned = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                            logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token
    zero = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                          frequency_penalty=0, presence_penalty=0)
    assert zero.choices[0].message.content == plain.choices[0].message.content     # greedy stays greedy
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -2.5}, {"logit_bias": {"5": 200}},
                {"top_logprobs": 21, "logprobs": True}, {"logit_bias": {"999999999": 1}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **bad)
        assert info.value.body["param"] == next(iter(bad)), info.value.body


def test_any_user_string_is_accepted_and_keeps_one_agent(gateway):
    with gateway.client() as c:
        agents = []
        for user in ("john doe", "a+b@x.com", "u" * 200, "john doe"):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1, "user": user})
            assert r.status_code == 200, r.text
            agents.append(r.headers["x-kvcmas-agent"])
        assert agents[0] == agents[3] and len(set(agents)) == 3 and agents[0].startswith("john-doe-")


def test_unknown_models_are_404_and_aliases_are_served(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert info.value.body["type"] == "not_found_error"
    r = client.chat.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=ASK, max_tokens=1)
    assert r.model == MODEL
    assert client.models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct").id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("extra", [{"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]},
                                   {"prediction": {"type": "content", "content": "x"}}, {"n": 3},
                                   {"reasoning_effort": "low"}, {"store": True}])
def test_unsupported_fields_are_400_naming_them(client, extra):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **extra)
    assert info.value.body["param"] in extra


def test_unknown_fields_are_400_too(gateway):
    with gateway.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "min_p": 0.1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p"


def test_logprobs_of_constrained_output_floor_forbidden_tokens(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=20,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    tops = [t.logprob for e in r.choices[0].logprobs.content for t in e.top_logprobs]
    assert min(tops) == -9999.0 and all(t >= -9999.0 for t in tops)     # the grammar forbids most tokens
    assert all(e.logprob > -9999.0 for e in r.choices[0].logprobs.content)
