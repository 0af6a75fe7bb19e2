"""The official openai client against the live gateway: sync, async, streaming, tools, structured output."""
from __future__ import annotations

import json

import openai
import pytest

from serve_gateway import API_KEY, MODEL  # type: ignore[import-not-found]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "system", "content": "You are a terse assistant."},
       {"role": "user", "content": "Name one colour."}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(client, gateway):
    ids = [m.id for m in client.models.list()]
    assert ids == [gateway.engine.model_name]


def test_sync_completion_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 6 and u.prompt_tokens > 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    ext = u.model_extra["kvcmas"]
    assert u.prompt_tokens_details.cached_tokens == ext["kept_tokens"]
    assert ext["reuse"] == "kvcmas" and ext["agent"].startswith("sys-")
    # The same request again: its whole prompt prefix is cached now and reported as such.
    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content      # greedy
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_async_client_and_streaming_match_non_streaming(gateway):
    aclient = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Count from one to five in words."}]
    whole = await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    chunks = [c async for c in await aclient.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    await aclient.close()


def test_forced_tool_choice_gives_a_well_formed_call(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    # The call and its result go back as OpenAI messages; the model answers in text.
    history = [{"role": "user", "content": "What is the weather in Paris?"}, choice.message.model_dump(),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_streamed_tool_call_deltas(client):
    """As OpenAI streams a call: a first delta with index, id, type and name (arguments ""), then argument
    fragments only; the openai client's own accumulation gives the same call as the non-streamed reply."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
               tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
               max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    head, fragments = deltas[0], deltas[1:]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (0, "function", "get_time", "")
    assert head.id.startswith("call_") and len(fragments) > 1
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    (call,) = state.get_final_completion().choices[0].message.tool_calls
    assert call.id == head.id and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_bad_params_are_400_in_openai_format(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, n=2)
    assert info.value.body["param"] == "n" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, temperature=7)
    assert info.value.body["param"] == "temperature"


async def test_concurrent_requests_batch_in_the_engine(gateway):
    """Three requests at once share engine steps: fewer steps than tokens generated."""
    import asyncio

    aclient = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)
    before = gateway.stats()["counters"]
    topics = ("rivers", "mountains", "deserts")
    replies = await asyncio.gather(*(aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"One sentence about {t}."}], max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True}) for t in topics))
    await aclient.close()
    after = gateway.stats()["counters"]
    generated = sum(r.usage.completion_tokens for r in replies)
    assert generated == after["completion_tokens"] - before["completion_tokens"] >= 9
    assert after["steps"] - before["steps"] < generated
    assert after["max_batch_seqs"] >= 2


def test_seed_makes_sampling_repeatable_and_stop_ends_the_reply(client):
    msgs = [{"role": "user", "content": "Tell me a short fact about owls."}]
    a, b = (client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stop=[" "])
    assert " " not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
