"""The streamed tool-call splitter: OpenAI-shaped deltas, and cut or invalid blocks never valid."""
from __future__ import annotations

import json

import pytest

from kvcmas_agents.chat.tool_stream import ToolCallStreamer
from kvcmas_agents.chat.tools import parse_tool_calls

NAMES = {"get_time", "get_weather"}
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "Asia/Tokyo", "n": [1, {"a": "}"}]}}</tool_call>'


def run(text: str, step: int, names=NAMES, max_calls=None):
    """Feed ``text`` in ``step``-character pieces; return content and per-index accumulated calls."""
    s = ToolCallStreamer(names, max_calls)
    content, deltas = "", []
    for i in range(0, len(text), step):
        shown, d = s.push(text[i:i + step])
        content, deltas = content + shown, deltas + d
    shown, d = s.finish(parse_tool_calls(text, names).tool_calls)
    content, deltas = content + shown, deltas + d
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.arguments == ""      # the first delta names the call
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.name is None
            calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_call_streams_name_first_then_argument_fragments(step):
    text = "Let me check." + CALL + " Done."
    content, calls, deltas = run(text, step)
    assert content == "Let me check. Done."
    assert [c["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["arguments"]) == parse_tool_calls(text, NAMES).tool_calls[0].arguments
    if step < 10:                       # generated piece by piece: the arguments come in several fragments
        assert sum(d.id is None for d in deltas) > 1


@pytest.mark.parametrize("cut", [30, 45, 60, 80, len(CALL) - len("}</tool_call>")])
def test_a_cut_call_never_has_valid_arguments(cut):
    text = CALL[:cut]
    content, calls, _ = run(text, 2)
    assert content == "" and parse_tool_calls(text, NAMES).tool_calls == []
    for call in calls:
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["arguments"])


def test_an_unterminated_but_complete_block_is_a_call_as_when_not_streamed():
    text = CALL[:-len("</tool_call>")]
    assert len(parse_tool_calls(text, NAMES).tool_calls) == 1
    _, calls, _ = run(text, 4)
    assert json.loads(calls[0]["arguments"])["tz"] == "Asia/Tokyo"


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"} trailing</tool_call>',   # outer object broken
    '<tool_call>{"name": "nope", "arguments": {"tz": "UTC"}}</tool_call>',               # unknown tool
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"</tool_call>',             # cut by the close tag
])
def test_an_invalid_block_is_no_call(block):
    assert parse_tool_calls(block, NAMES).tool_calls == []
    _, calls, _ = run(block, 3)
    for call in calls:
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["arguments"])


def test_other_shapes_arrive_whole_and_several_calls_get_indices():
    text = ('<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>\n'
            + CALL + '<tool_call>[{"name": "get_time", "arguments": {"tz": "UTC"}}]</tool_call>')
    want = parse_tool_calls(text, NAMES).tool_calls
    content, calls, _ = run(text, 5)
    assert content.strip() == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(w.name, w.arguments) for w in want]
    assert len({c["id"] for c in calls}) == 3
    _, capped, _ = run(text, 5, max_calls=1)
    assert [c["name"] for c in capped] == ["get_weather"]


def test_a_bare_json_reply_gets_its_calls_at_the_end():
    text = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    _, calls, _ = run(text, 4)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"tz": "UTC"})]
