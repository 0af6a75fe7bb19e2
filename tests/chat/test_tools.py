"""Tests for tool definitions and forgiving tool-call parsing."""
from __future__ import annotations

import json
import re

import pytest

from kvcmas_agents.errors import InvalidRequestError
from kvcmas_agents.chat.tools import (
    InvalidToolCall,
    check_tool_choice,
    ToolCall,
    format_tool_call,
    normalize_tools,
    parse_tool_calls,
    tool_choice_instruction,
    tool_instructions,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMES = {"get_weather", "add"}
ID_RE = re.compile(r"^call_[0-9a-f]{24}$")


# -- normalize_tools ------------------------------------------------------


def test_normalize_openai_and_bare_forms() -> None:
    bare = {"name": "add", "description": "Add numbers", "parameters": {"type": "object", "properties": {}}}
    out = normalize_tools([WEATHER, bare])
    assert [t["type"] for t in out] == ["function", "function"]
    assert out[0]["function"] == WEATHER["function"]
    assert out[1]["function"]["name"] == "add"
    assert out[1]["function"]["description"] == "Add numbers"


def test_normalize_defaults_parameters_and_description() -> None:
    (out,) = normalize_tools([{"name": "ping"}])
    assert out["function"]["parameters"] == {"type": "object", "properties": {}}
    assert out["function"]["description"] == ""


def test_normalize_none_and_empty() -> None:
    assert normalize_tools(None) == []
    assert normalize_tools([]) == []


def test_normalize_does_not_mutate_input() -> None:
    tool = {"name": "ping"}
    normalize_tools([tool])
    assert tool == {"name": "ping"}


@pytest.mark.parametrize(
    "tools, match",
    [
        ("get_weather", "must be a list"),
        ([42], r"tools\[0\] must be a dict"),
        ([{"description": "no name"}], "non-empty string 'name'"),
        ([{"name": ""}], "non-empty string 'name'"),
        ([{"name": 3}], "non-empty string 'name'"),
        ([{"name": "x", "parameters": "oops"}], "parameters"),
        ([{"name": "x", "description": 5}], "description"),
        ([{"type": "retrieval", "function": {"name": "x"}}], "unsupported tool type"),
        ([{"type": "function", "function": "x"}], "must be a dict"),
        ([{"name": "x"}, {"name": "x"}], "duplicate"),
    ],
)
def test_normalize_rejects_bad_tools(tools, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        normalize_tools(tools)


# -- instructions and formatting -----------------------------------------


def test_tool_instructions_describe_tools_and_format() -> None:
    text = tool_instructions([WEATHER])
    assert "<tool_call>" in text and "</tool_call>" in text
    assert json.dumps(WEATHER["function"]) in text
    assert "must call" not in text


@pytest.mark.parametrize("choice", ["required", "any"])
def test_tool_instructions_required(choice: str) -> None:
    assert "must call at least one tool" in tool_instructions([WEATHER], choice)


def test_tool_instructions_specific_tool() -> None:
    assert "must call the tool 'get_weather'" in tool_instructions([WEATHER], "get_weather")
    forced = {"type": "function", "function": {"name": "get_weather"}}
    assert "'get_weather'" in tool_choice_instruction(forced)


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_tool_choice_without_requirement(choice) -> None:
    assert tool_choice_instruction(choice) == ""


def test_tool_choice_invalid() -> None:
    with pytest.raises(InvalidRequestError):
        tool_choice_instruction(5)


def test_format_tool_call_round_trips() -> None:
    text = format_tool_call("get_weather", {"city": "Paris"})
    assert text == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.tool_calls[0].name == "get_weather"
    assert parsed.tool_calls[0].arguments == {"city": "Paris"}


def test_format_tool_call_accepts_json_string() -> None:
    assert format_tool_call("add", '{"a": 1}') == format_tool_call("add", {"a": 1})
    assert format_tool_call("add", None) == format_tool_call("add", {})


# -- parse_tool_calls ------------------------------------------------------


def test_parse_plain_text() -> None:
    out = parse_tool_calls("  Hello there.  ", NAMES)
    assert out.content == "Hello there."
    assert out.tool_calls == [] and out.invalid_tool_calls == []


def test_parse_single_call_with_surrounding_text() -> None:
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    out = parse_tool_calls(text, NAMES)
    assert out.content == "Let me check."
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == ("get_weather", {"city": "Oslo"})
    assert ID_RE.match(call.id)


def test_parse_multiple_calls_have_distinct_ids() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    out = parse_tool_calls(text, NAMES)
    assert [c.name for c in out.tool_calls] == ["add", "get_weather"]
    assert out.tool_calls[0].arguments == {"a": 1, "b": 2}
    assert out.tool_calls[0].id != out.tool_calls[1].id
    assert out.content == ""


def test_parse_string_arguments_and_parameters_key() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Lima"}}</tool_call>'
    )
    out = parse_tool_calls(text, NAMES)
    assert [c.arguments for c in out.tool_calls] == [{"a": 3}, {"city": "Lima"}]


def test_parse_missing_arguments_means_empty() -> None:
    out = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', NAMES)
    assert out.tool_calls[0].arguments == {}


def test_parse_unterminated_final_block() -> None:
    out = parse_tool_calls('Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)
    assert out.content == "Sure."
    assert out.tool_calls[0].arguments == {"a": 1}


def test_parse_truncated_json_is_invalid() -> None:
    out = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": ', NAMES)
    assert out.tool_calls == []
    (bad,) = out.invalid_tool_calls
    assert isinstance(bad, InvalidToolCall)
    assert bad.name == "add"
    assert "invalid JSON" in bad.error
    assert bad.arguments is not None and bad.arguments.startswith('{"name"')


def test_parse_a_call_cut_by_max_tokens_keeps_its_text() -> None:
    text = 'Sure.<tool_call>{"name": "add", "arguments": {"a": '
    out = parse_tool_calls(text, NAMES, cut=True)
    assert out.content == text and out.tool_calls == []
    assert "cut off by max_tokens" in out.invalid_tool_calls[0].error
    done = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert parse_tool_calls(done, NAMES, cut=True).content == ""      # a finished call is no cut
    whole = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES, cut=True)
    assert whole.content == "" and whole.tool_calls[0].arguments == {"a": 1}   # cut right after complete JSON


def test_parse_garbage_block_is_invalid_and_keeps_others() -> None:
    text = '<tool_call>not json at all</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>'
    out = parse_tool_calls(text, NAMES)
    assert [c.name for c in out.tool_calls] == ["add"]
    (bad,) = out.invalid_tool_calls
    assert bad.name is None and bad.arguments == "not json at all"
    assert bad.error


def test_parse_tolerates_fence_and_stray_text_inside_block() -> None:
    text = '<tool_call>```json\n{"name": "add", "arguments": {"a": 1}}\n```</tool_call>'
    assert parse_tool_calls(text, NAMES).tool_calls[0].arguments == {"a": 1}
    text = '<tool_call>call: {"name": "add", "arguments": {"a": 2}} done</tool_call>'
    assert parse_tool_calls(text, NAMES).tool_calls[0].arguments == {"a": 2}


@pytest.mark.parametrize(
    "body, error",
    [
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": "add", "arguments": "{bad"}', "not valid JSON"),
        ('{"name": "add", "arguments": [1, 2]}', "JSON object"),
        ('"just a string"', "JSON object"),
    ],
)
def test_parse_malformed_calls(body: str, error: str) -> None:
    out = parse_tool_calls(f"<tool_call>{body}</tool_call>", NAMES)
    assert out.tool_calls == []
    assert error in out.invalid_tool_calls[0].error


def test_parse_unknown_tool_name() -> None:
    out = parse_tool_calls('<tool_call>{"name": "launch", "arguments": {"x": 1}}</tool_call>', NAMES)
    assert out.tool_calls == []
    (bad,) = out.invalid_tool_calls
    assert bad.name == "launch" and "unknown tool" in bad.error
    assert json.loads(bad.arguments) == {"x": 1}


def test_parse_any_name_without_tool_names() -> None:
    out = parse_tool_calls('<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    assert out.tool_calls[0].name == "launch"


def test_parse_list_of_calls_in_one_block() -> None:
    body = json.dumps([{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}])
    out = parse_tool_calls(f"<tool_call>{body}</tool_call>", NAMES)
    assert [c.name for c in out.tool_calls] == ["add", "get_weather"]


def test_parse_keeps_given_id() -> None:
    out = parse_tool_calls('<tool_call>{"id": "abc", "name": "add", "arguments": {}}</tool_call>', NAMES)
    assert out.tool_calls[0].id == "abc"


def test_parse_bare_json_reply() -> None:
    out = parse_tool_calls(' {"name": "get_weather", "arguments": {"city": "Paris"}} ', NAMES)
    assert out.content == ""
    assert out.tool_calls[0].arguments == {"city": "Paris"}


def test_parse_fenced_json_reply() -> None:
    text = '```json\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n```'
    out = parse_tool_calls(text, NAMES)
    assert out.content == ""
    assert out.tool_calls[0].name == "add" and out.tool_calls[0].arguments == {"a": 1}


def test_bare_json_needs_known_name_and_tool_names() -> None:
    unknown = '{"name": "launch", "arguments": {}}'
    assert parse_tool_calls(unknown, NAMES).tool_calls == []
    assert parse_tool_calls(unknown, NAMES).content == unknown
    known = '{"name": "add", "arguments": {}}'
    assert parse_tool_calls(known).tool_calls == []
    assert parse_tool_calls(known).content == known
    # A JSON answer that merely has a "name" field is content, not a call.
    person = '{"name": "add", "age": 3}'
    assert parse_tool_calls(person, NAMES).tool_calls == []


def test_parse_never_raises_on_odd_input() -> None:
    for text in ["", "</tool_call>", "<tool_call>", "<tool_call></tool_call>", "{", "[]", "null"]:
        out = parse_tool_calls(text, NAMES)
        assert isinstance(out.content, str)
        assert out.tool_calls == []


@pytest.mark.parametrize("choice", ["bogus", {"type": "function", "function": {"name": "bogus"}}, 3, ""])
def test_check_tool_choice_rejects_unknown_tools(choice) -> None:
    with pytest.raises(InvalidRequestError):
        check_tool_choice(choice, normalize_tools([WEATHER]))


@pytest.mark.parametrize("choice", ["get_weather", "required", "auto", None])
def test_check_tool_choice_accepts_modes_and_known_tools(choice) -> None:
    check_tool_choice(choice, normalize_tools([WEATHER]))


def test_check_tool_choice_needs_tools_to_require_one() -> None:
    with pytest.raises(InvalidRequestError):
        check_tool_choice("required", [])
    with pytest.raises(InvalidRequestError):
        check_tool_choice("get_weather", [])
