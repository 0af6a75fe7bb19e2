"""Grammar-constrained decoding end to end on the real default model."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvcmas_agents import InvalidRequestError, SamplingParams

JOKE = {"type": "object", "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
        "required": ["setup", "punchline"]}
JOKE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Joke", "schema": JOKE}}
JOKE_MESSAGES = [{"role": "system", "content": "Reply with only a JSON object."},
                 {"role": "user", "content": "Tell me a joke about cats. Respond in JSON with `setup` and "
                                             "`punchline` keys"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                      "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
]
HI = [{"role": "user", "content": "Say hi."}]


async def test_json_schema_output_parses_against_the_schema(engine_none):
    out = await engine_none.generate(JOKE_MESSAGES, sampling=SamplingParams(max_tokens=64,
                                                                            response_format=JOKE_FORMAT))
    # a complete grammar allows only a stop token: the request ends there without sampling it
    assert out.finish_reason == "stop" and out.stop_reason is None
    joke = json.loads(out.text)
    assert list(joke) == ["setup", "punchline"] and all(isinstance(v, str) and v for v in joke.values())


async def test_json_object_mode_gives_one_object(engine_none):
    messages = [{"role": "system", "content": "Reply with only a JSON object."},
                {"role": "user", "content": "Give the name and the age of a cat, as JSON."}]
    out = await engine_none.generate(messages, sampling=SamplingParams(
        max_tokens=48, response_format={"type": "json_object"}))
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


async def test_unconstrained_model_does_not_answer_in_json(engine_none):
    """The constraint is what makes the output JSON: without it this prompt gets prose."""
    out = await engine_none.generate(JOKE_MESSAGES[1:], sampling=SamplingParams(max_tokens=24))
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize("choice, name", [("add", "add"), ({"type": "function", "function": {"name": "add"}}, "add"),
                                          ("required", "get_weather"), ("any", "get_weather")])
async def test_a_forced_tool_call_is_well_formed(engine_none, choice, name):
    question = "What is 3 + 4?" if name == "add" else "What is the weather in Paris?"
    out = await engine_none.generate([{"role": "user", "content": question}], sampling=SamplingParams(max_tokens=64),
                                     tools=TOOLS, tool_choice=choice)
    assert out.finish_reason == "tool_calls" and not out.invalid_tool_calls
    assert out.text.startswith("<tool_call>") and out.text.endswith("</tool_call>")
    (call,) = out.tool_calls
    assert call.name == name
    assert (call.arguments == {"a": 3, "b": 4}) if name == "add" else isinstance(call.arguments["city"], str)


async def test_a_forced_call_jumps_over_what_the_grammar_fixes(engine_none):
    """The forced parts (tag, name, keys, closing) go in unsampled, in one chunk: few model steps, same call."""
    steps = engine_none.stats()["counters"]["steps"]
    out = await engine_none.generate([{"role": "user", "content": "What is 3 + 4?"}],
                                     sampling=SamplingParams(max_tokens=64), tools=TOOLS, tool_choice="add")
    steps = engine_none.stats()["counters"]["steps"] - steps
    assert out.text == '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    assert out.usage.completion_tokens == 31 and steps <= 10, steps     # 32 steps, one per token, before


async def test_a_forced_call_cut_by_max_tokens_keeps_its_partial_text(engine_none):
    out = await engine_none.generate([{"role": "user", "content": "What is 3 + 4?"}],
                                     sampling=SamplingParams(max_tokens=20), tools=TOOLS, tool_choice="add")
    assert out.finish_reason == "length" and not out.tool_calls
    assert out.content == out.text and out.content.startswith('<tool_call>{"name": "add", "arguments": {')
    assert "cut off by max_tokens" in out.invalid_tool_calls[0].error


async def test_a_forced_call_of_a_tool_without_parameters(engine_none):
    tools = [{"type": "function", "function": {"name": "ping", "description": "Ping the server"}}]
    out = await engine_none.generate(HI, sampling=SamplingParams(max_tokens=32), tools=tools, tool_choice="ping")
    assert out.text == '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("ping", {})]


async def test_constrained_and_free_requests_batch_without_touching_each_other(engine_none):
    free = SamplingParams(max_tokens=24)
    alone = await engine_none.generate(HI, sampling=free)
    hits, misses = engine_none.grammars.hits, engine_none.grammars.misses
    outs = await asyncio.gather(
        engine_none.generate(JOKE_MESSAGES, sampling=SamplingParams(max_tokens=64, response_format=JOKE_FORMAT)),
        engine_none.generate(HI, sampling=free),
        engine_none.generate(JOKE_MESSAGES, sampling=SamplingParams(max_tokens=64, response_format=JOKE_FORMAT)))
    assert outs[1].token_ids == alone.token_ids
    assert json.loads(outs[0].text) == json.loads(outs[2].text)
    # the schema compiles at most once; the second request finds it cached
    assert engine_none.grammars.misses <= misses + 1 and engine_none.grammars.hits >= hits + 1


@pytest.mark.parametrize("kwargs, match", [
    ({"sampling": SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})},
     "cannot constrain output"),
    ({"sampling": SamplingParams(response_format={"type": "xml"})}, "unsupported response_format"),
    ({"sampling": SamplingParams(response_format={"type": "json_schema"})}, "needs"),
    ({"sampling": SamplingParams(response_format={"type": "json_object"}), "tools": TOOLS, "tool_choice": "add"},
     "cannot both"),
    ({"sampling": SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)}, "ignore_eos"),
    ({"tools": TOOLS, "tool_choice": "multiply"}, "not one of the tools"),
    ({"tool_choice": "required"}, "needs tools"),
])
async def test_requests_the_engine_cannot_constrain_fail_before_running(engine_none, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        await engine_none.generate(HI, **kwargs)
