"""The answer-or-call decision step (tool_choice "auto") on the real default model."""
from __future__ import annotations

import pytest

from kvcmas_agents import InvalidRequestError, SamplingParams, ToolDecision

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SF = [{"role": "user", "content": "What is the weather in San Francisco, CA?"}]
SAMPLING = SamplingParams(max_tokens=32)


def requests(engine) -> int:
    return engine.stats()["counters"]["requests"]


async def test_a_request_a_tool_is_for_becomes_a_call(engine_prefix):
    free = await engine_prefix.generate(SF, sampling=SAMPLING, tools=[WEATHER])
    assert not free.tool_calls                      # left to itself, the model answers in prose
    out = await engine_prefix.generate(SF, sampling=SAMPLING, tools=[WEATHER], tool_decision=ToolDecision())
    assert out.finish_reason == "tool_calls" and not out.invalid_tool_calls
    (call,) = out.tool_calls
    assert call.name == "get_weather" and "San Francisco" in call.arguments["location"]


async def test_a_plain_question_is_answered_in_text(engine_prefix):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = await engine_prefix.generate(messages, sampling=SAMPLING, tools=[ADD], tool_decision=ToolDecision())
    assert not out.tool_calls and "Paris" in out.content


def test_without_tools_the_step_is_skipped_and_the_output_unchanged(engine_prefix):
    messages = [{"role": "user", "content": "Say hi."}]
    plain = engine_prefix.generate_sync(messages, sampling=SAMPLING)
    before = requests(engine_prefix)
    decided = engine_prefix.generate_sync(messages, sampling=SAMPLING, tool_decision=ToolDecision())
    assert requests(engine_prefix) == before + 1           # no scoring request
    assert (decided.token_ids, decided.text) == (plain.token_ids, plain.text)


def test_the_scoring_request_runs_once_and_the_threshold_decides(engine_prefix):
    before = requests(engine_prefix)
    never = engine_prefix.generate_sync(SF, sampling=SAMPLING, tools=[WEATHER], tool_decision=ToolDecision(0.0))
    assert requests(engine_prefix) == before + 2 and not never.tool_calls    # log p <= 0: never calls


def test_after_a_tool_result_the_reply_is_text(engine_prefix):
    history = SF + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"location": "San Francisco, CA"}}}]},
        {"role": "tool", "content": "It's sunny.", "tool_call_id": "c1"}]
    decision = ToolDecision()
    assert not decision.scores(history) and ToolDecision(after_tool_result=True).scores(history)
    before = requests(engine_prefix)
    out = engine_prefix.generate_sync(history, sampling=SAMPLING, tools=[WEATHER], tool_decision=decision)
    assert out.finish_reason in ("stop", "length") and not out.tool_calls and out.content
    assert requests(engine_prefix) == before + 1                 # answered without scoring


def test_what_the_step_decides():
    decision = ToolDecision()
    assert decision.applies([WEATHER], None) and decision.applies([WEATHER], "auto") and decision.scores(SF)
    assert not decision.applies([WEATHER], "required") and not decision.applies([WEATHER], "get_weather")
    assert not decision.applies([], "auto") and not decision.applies(None, None)
    assert (decision.calls(-3.0), decision.calls(-12.0)) == (True, False)
    for bad in (float("nan"), "high", True):
        with pytest.raises(InvalidRequestError, match="threshold"):
            ToolDecision(bad)
