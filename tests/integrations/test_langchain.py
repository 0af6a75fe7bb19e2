"""ChatKVCMAS on the real default model, plus the pure conversion helpers.

The 135M model rarely follows tool or JSON instructions on its own, so the tool-call and structured
output tests ask it to copy a well-formed answer, which it does reliably; that exercises the
adapter's parsing end to end.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumpd, loads
from langchain_core.messages import (
    AIMessage, AIMessageChunk, BaseMessage, ChatMessage, FunctionMessage, HumanMessage, SystemMessage, ToolMessage,
)
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from kvcmas_agents import ReuseOptions
from kvcmas_agents.chat.tools import InvalidToolCall
from kvcmas_agents.engine.outputs import RequestOutput, Usage
from kvcmas_agents.integrations import langchain as lc_module
from kvcmas_agents.integrations._lc_messages import ai_message, final_chunk, to_engine_messages
from kvcmas_agents.chat.tool_filter import ToolBlockFilter
from kvcmas_agents.integrations.langchain import ChatKVCMAS
from kvcmas_agents.registry import get_engine


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


JOKE = {"setup": "Why did the cat sit on the computer?", "punchline": "To keep an eye on the mouse."}
COPY_CALL = ("Copy this text exactly, with no other words:\n"
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
COPY_JOKE_CALL = ("Copy this text exactly:\n<tool_call>"
                  + json.dumps({"name": "Joke", "arguments": JOKE}) + "</tool_call>")
COPY_JSON = "Copy this JSON exactly:\n" + json.dumps(JOKE)


@pytest.fixture(scope="module")
def llm(engine_prefix) -> ChatKVCMAS:
    return ChatKVCMAS(engine=engine_prefix, max_tokens=24, agent="lc-tests")


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


# --- conversion (no model) ----------------------------------------------------------------------
def test_message_conversion_roles_tool_calls_and_text_blocks():
    msgs = to_engine_messages([
        SystemMessage("sys"),
        HumanMessage([{"type": "text", "text": "a"}, "b", {"type": "text", "text": "c"}], name="ann"),
        AIMessage([{"type": "text", "text": "calling"}, {"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
                  tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "t1", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="t1"),
        ChatMessage(role="developer", content="dev"),
    ])
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "abc", "name": "ann"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"type": "function", "id": "t1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "developer", "content": "dev"},
    ]


def test_message_conversion_on_top_of_langchains_converter():
    streamed = AIMessageChunk([{"type": "text", "text": "Hel", "index": 0}, {"type": "text", "text": "lo", "index": 1}])
    msgs = to_engine_messages([
        SystemMessage("sys", name="boss"),        # a system name names no agent: dropped
        streamed,                                 # text blocks re-join with no separator
        AIMessage("", tool_calls=[{"name": "add", "args": {}, "id": None}]),   # no id: left to the engine
        FunctionMessage(name="add", content="3"),  # the engine has no "function" role
        AIMessage([{"type": "reasoning", "reasoning": "hidden"}, {"type": "text", "text": "shown"}]),
    ])
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "assistant", "content": "Hello"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "3", "name": "add"},
        {"role": "assistant", "content": "shown"},
    ]

    class Custom(BaseMessage):
        type: str = "custom"

    with pytest.raises(ValueError, match=r"messages\[1\]: unsupported message"):
        to_engine_messages([HumanMessage("hi"), Custom(content="x")])


@pytest.mark.parametrize("block", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "image", "base64": "AAAA", "mime_type": "image/png"},
    {"type": "file", "base64": "AAAA", "mime_type": "application/pdf"},
])
def test_media_blocks_raise_a_clear_value_error(block):
    with pytest.raises(ValueError, match="text-only"):
        to_engine_messages([HumanMessage([{"type": "text", "text": "what is this?"}, block])])


def test_tool_block_filter_hides_blocks_split_across_pushes():
    f = ToolBlockFilter()
    pieces = ["Sure. <to", "ol_call>{\"name\": ", "\"add\"}</tool", "_call> done <", "b>"]
    shown = "".join(f.push(p) for p in pieces) + f.flush()
    assert shown == "Sure.  done <b>"


# --- calls on the real model ----------------------------------------------------------------------
async def test_ainvoke_usage_and_response_metadata(llm):
    msg = await llm.ainvoke("Hello")
    assert isinstance(msg, AIMessage) and msg.content
    usage = msg.usage_metadata
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert isinstance(usage["input_token_details"]["cache_read"], int)
    meta = msg.response_metadata
    assert meta["model_name"] == "smollm2-135m-instruct" and meta["model_provider"] == "kvcmas"
    assert meta["finish_reason"] in ("stop", "length") and meta["ttft_s"] > 0
    assert meta["agent"] == "lc-tests" and meta["reuse"] == "prefix"


async def test_repeat_call_reports_cache_read(llm):
    messages = [SystemMessage("You are a careful assistant. " * 6), HumanMessage("Name one colour.")]
    await llm.ainvoke(messages)
    again = await llm.ainvoke(messages)
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    assert again.response_metadata["cached_tokens"] > 0


def test_sync_invoke_and_stream_match_with_callbacks(llm):
    whole = llm.invoke("Hello")
    handler = Tokens()
    chunks = list(llm.stream("Hello", config={"callbacks": [handler]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    full = sum(chunks[1:], chunks[0])
    assert full.content == whole.content
    assert "".join(handler.tokens) == whole.content
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.response_metadata["finish_reason"] == whole.response_metadata["finish_reason"]
    assert last.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"]
    assert [c for c in chunks[:-1] if c.usage_metadata] == []   # usage only once


async def test_astream_matches_ainvoke(llm):
    whole = await llm.ainvoke("Name a fruit.")
    full = None
    async for chunk in llm.astream("Name a fruit."):
        full = chunk if full is None else full + chunk
    assert full.content == whole.content and full.chunk_position == "last"
    assert full.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]


async def test_streaming_field_routes_invoke_through_stream(engine_prefix):
    llm = ChatKVCMAS(engine=engine_prefix, max_tokens=8, streaming=True)
    handler = Tokens()
    msg = await llm.ainvoke("Hello", config={"callbacks": [handler]})
    assert msg.content and "".join(handler.tokens) == msg.content


async def test_sampling_fields_and_per_call_overrides(llm):
    short = await llm.bind(max_tokens=3).ainvoke("Write a long story about a dragon.")
    assert short.usage_metadata["output_tokens"] == 3 and short.response_metadata["finish_reason"] == "length"
    seeded = llm.model_copy(update={"temperature": 0.9, "seed": 7, "top_p": 0.9, "top_k": 20, "max_tokens": 6})
    a, b = await seeded.ainvoke("Say something."), await seeded.ainvoke("Say something.")
    assert a.content == b.content


async def test_openai_penalties_and_logit_bias_as_in_chat_openai(llm):
    biased = llm.model_copy(update={"frequency_penalty": 0.5, "presence_penalty": -1.0, "logit_bias": {7: -100}})
    s = biased._sampling(None, {})
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias) == (0.5, -1.0, {7: -100})
    assert llm._sampling(None, {}).logit_bias is None and llm._sampling(None, {}).frequency_penalty == 0.0
    with pytest.raises(ValueError, match="presence_penalty"):
        ChatKVCMAS(engine=llm.engine, presence_penalty=2.5)
    plain = await llm.bind(max_tokens=3).ainvoke("Hello")
    first = llm.engine.tokenize(plain.content)[0]
    banned = await llm.bind(max_tokens=3, logit_bias={first: -100}).ainvoke("Hello")
    assert llm.engine.tokenize(banned.content)[:1] != [first]


async def test_call_stop_replaces_the_field_as_in_chat_openai(engine_prefix):
    base = await ChatKVCMAS(engine=engine_prefix, max_tokens=24).ainvoke("Hello")
    assert "assist" in base.content    # "Hello! How can I assist you today?"
    llm = ChatKVCMAS(engine=engine_prefix, max_tokens=24, stop=["assist"])
    cut = await llm.ainvoke("Hello")
    assert cut.content == base.content[:base.content.index("assist")]
    assert cut.response_metadata["stop_reason"] == "assist"
    replaced = await llm.ainvoke("Hello", stop=["zzz"])
    assert replaced.content == base.content and replaced.response_metadata["stop_reason"] != "assist"


async def test_unexpected_call_arguments_and_bad_roles_fail_fast(llm):
    with pytest.raises(TypeError, match="unexpected call arguments"):
        await llm.ainvoke("hi", best_of=2)
    with pytest.raises(ValueError, match="unknown role"):
        await llm.ainvoke([ChatMessage(role="narrator", content="hi")])
    with pytest.raises(ValueError, match="text-only"):
        await llm.ainvoke([HumanMessage([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])])


def test_sync_stream_left_early_aborts_the_request(engine_prefix):
    llm = ChatKVCMAS(engine=engine_prefix, max_tokens=200)
    before = engine_prefix.stats()["counters"]["aborted"]
    for _ in llm.stream("Write a very long story about a dragon and a knight."):
        break
    deadline = time.monotonic() + 10
    while engine_prefix.stats()["counters"]["aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_prefix.stats()["counters"]["aborted"] == before + 1


# --- tools ------------------------------------------------------------------------------------
async def test_tool_calls_in_invoke_and_stream(llm):
    bound = llm.bind_tools([add], tool_choice="any").bind(max_tokens=40)
    msg = await bound.ainvoke(COPY_CALL)
    assert msg.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": msg.tool_calls[0]["id"],
                               "type": "tool_call"}]
    assert msg.content == "" and msg.response_metadata["finish_reason"] == "tool_calls"
    chunks = [c async for c in bound.astream(COPY_CALL)]
    assert all("<tool_call>" not in c.content for c in chunks)
    full = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert [b["type"] for b in full.content_blocks] == ["tool_call"]


async def test_tool_round_trip_history(llm):
    bound = llm.bind_tools([add])
    call = await bound.bind(max_tokens=40).ainvoke(COPY_CALL)
    result = add.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.content == "3"
    answer = await bound.ainvoke([HumanMessage(COPY_CALL), call, result, HumanMessage("What was the sum?")])
    assert isinstance(answer, AIMessage)


def test_bind_tools_validates_tool_choice(llm):
    for choice in ("auto", "none", "any", "required", True, "add", {"type": "function", "function": {"name": "add"}}):
        llm.bind_tools([add, Joke], tool_choice=choice)
    with pytest.raises(ValueError, match="names no bound tool"):
        llm.bind_tools([add], tool_choice="multiply")


async def test_tool_choice_none_sends_no_tools(llm):
    plain = await llm.bind(max_tokens=1).ainvoke("Hi")
    with_tools = await llm.bind_tools([add]).bind(max_tokens=1).ainvoke("Hi")
    no_tools = await llm.bind_tools([add], tool_choice="none").bind(max_tokens=1).ainvoke("Hi")
    assert with_tools.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"]
    assert no_tools.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"]


# --- structured output ------------------------------------------------------------------------------
@pytest.mark.parametrize("method,prompt", [("function_calling", COPY_JOKE_CALL), ("json_schema", COPY_JSON),
                                           ("json_mode", COPY_JSON)])
async def test_structured_output_methods(llm, method, prompt):
    chain = ChatKVCMAS(engine=llm.engine, max_tokens=48).with_structured_output(Joke, method=method)
    assert await chain.ainvoke(prompt) == Joke(**JOKE)
    as_dict = ChatKVCMAS(engine=llm.engine, max_tokens=48).with_structured_output(
        Joke.model_json_schema(), method=method)
    assert await as_dict.ainvoke(prompt) == JOKE


class City(BaseModel):
    name: str
    country: str


CAPITAL = "What is the capital of France?"


async def test_structured_output_defaults_to_constrained_json_schema(llm):
    """No copying prompt: the grammar makes the model answer in the schema's JSON."""
    chain = ChatKVCMAS(engine=llm.engine, max_tokens=48).with_structured_output(City, include_raw=True)
    out = await chain.ainvoke(CAPITAL)
    assert out["raw"].content.startswith('{"name": ') and out["parsed"].name == "Paris"
    free = await ChatKVCMAS(engine=llm.engine, max_tokens=48).ainvoke(CAPITAL)
    assert not free.content.startswith("{")


async def test_function_calling_forces_the_schema_tool(llm):
    chain = ChatKVCMAS(engine=llm.engine, max_tokens=48).with_structured_output(
        City, method="function_calling", include_raw=True)
    out = await chain.ainvoke(CAPITAL)
    assert [c["name"] for c in out["raw"].tool_calls] == ["City"] and isinstance(out["parsed"], City)


@pytest.mark.parametrize("choice", ["add", "any", {"type": "function", "function": {"name": "add"}}])
async def test_tool_choice_forces_a_well_formed_call(llm, choice):
    msg = await llm.bind_tools([add], tool_choice=choice).bind(max_tokens=40).ainvoke("What is 3 + 4?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 3, "b": 4})]
    assert not msg.invalid_tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"


async def test_a_forced_call_cut_by_max_tokens_comes_back_as_text(llm):
    bound = llm.bind_tools([add], tool_choice="add").bind(max_tokens=20)
    msg = await bound.ainvoke("What is 3 + 4?")
    assert msg.response_metadata["finish_reason"] == "length" and not msg.tool_calls
    assert msg.content.startswith('<tool_call>{"name": "add", "arguments": {')
    assert "cut off by max_tokens" in msg.invalid_tool_calls[0]["error"]
    chunks = [c async for c in bound.astream("What is 3 + 4?")]
    assert sum(chunks[1:], chunks[0]).content == msg.content


async def test_structured_output_include_raw_and_parse_errors(llm):
    chain = ChatKVCMAS(engine=llm.engine, max_tokens=48).with_structured_output(
        Joke, method="json_schema", include_raw=True)
    ok = await chain.ainvoke(COPY_JSON)
    assert ok["parsed"] == Joke(**JOKE) and ok["parsing_error"] is None and isinstance(ok["raw"], AIMessage)
    bad = await ChatKVCMAS(engine=llm.engine, max_tokens=4).with_structured_output(
        Joke, method="json_schema", include_raw=True).ainvoke("Say hello.")
    assert bad["parsed"] is None and bad["parsing_error"] is not None


async def test_json_schema_instruction_reaches_the_system_prompt(llm):
    plain = await llm.bind(max_tokens=1).ainvoke([SystemMessage("Be brief."), HumanMessage("Hi")])
    raw = await ChatKVCMAS(engine=llm.engine, max_tokens=1).with_structured_output(
        Joke, method="json_schema", include_raw=True).ainvoke([SystemMessage("Be brief."), HumanMessage("Hi")])
    assert raw["raw"].usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"] + 20


# --- engine sharing ------------------------------------------------------------------------------
def test_instances_share_the_registry_engine():
    a, b = ChatKVCMAS(), ChatKVCMAS(model="smollm2-135m-instruct", temperature=0.5)
    assert a.get_engine() is b.get_engine() is get_engine()
    explicit = ChatKVCMAS(engine=a.get_engine())
    assert "engine" not in explicit.model_dump() and explicit._llm_type == "kvcmas"


def test_shared_engine_is_created_with_kvcmas_unless_reuse_is_set(engine_prefix, monkeypatch):
    created: list[dict] = []
    monkeypatch.setattr(lc_module, "get_engine", lambda model, **kw: created.append(kw) or engine_prefix)
    ChatKVCMAS().get_engine()
    ChatKVCMAS(reuse="prefix").get_engine()
    assert created == [{"reuse": "kvcmas"}, {"reuse": "prefix"}]


async def test_reuse_knobs_apply_per_request(engine_prefix):
    llm = ChatKVCMAS(engine=engine_prefix, max_tokens=4, agent="reuse-knobs", reuse=ReuseOptions("naive", 0.5))
    msgs = [HumanMessage("hi")]
    assert llm._request(msgs, None, None, {})[1]["reuse_options"] == ReuseOptions("naive", 0.5, None, None)
    # per call, knob by knob: a mode's name replaces only the mode
    assert llm._request(msgs, None, None, {"reuse": ReuseOptions("kvcmas", rank=4)})[1]["reuse_options"] == \
        ReuseOptions("kvcmas", 0.5, 4, None)
    assert llm._request(msgs, None, None, {"reuse": "kvcmas"})[1]["reuse_options"] == ReuseOptions("kvcmas", 0.5)
    assert ChatKVCMAS(reuse="naive").reuse == "naive"
    with pytest.raises(ValueError, match="reuse must be"):
        ChatKVCMAS(reuse="everything")
    with pytest.raises(ValueError, match="recompute_ratio"):
        ChatKVCMAS(reuse=ReuseOptions(recompute_ratio=2.0))
    with pytest.raises(ValueError, match="reference"):
        llm._request(msgs, None, None, {"reuse": ReuseOptions(reference="nowhere")})

    # On the prefix engine a repeated prompt is a cache hit, unless the request asks for no reuse.
    plain = ChatKVCMAS(engine=engine_prefix, max_tokens=4, agent="reuse-knobs")
    prompt = [SystemMessage("You are a terse assistant. " * 6), HumanMessage("Name a fruit.")]
    await plain.ainvoke(prompt)
    hit = await plain.ainvoke(prompt)
    assert hit.response_metadata["reuse"] == "prefix" and hit.response_metadata["cached_tokens"] > 0
    miss = await plain.bind(reuse="none").ainvoke(prompt)
    assert miss.response_metadata["reuse"] == "none" and miss.response_metadata["cached_tokens"] == 0
    assert miss.usage_metadata["input_token_details"]["cache_read"] == 0


def test_the_separate_reuse_knobs_still_work_with_a_deprecation_warning(engine_prefix):
    with pytest.warns(DeprecationWarning, match="recompute_ratio, reference as separate arguments"):
        llm = ChatKVCMAS(engine=engine_prefix, reuse="naive", recompute_ratio=0.5, reference="chain")
    assert llm.reuse == ReuseOptions("naive", 0.5, None, "chain")
    with pytest.warns(DeprecationWarning, match="read reuse.recompute_ratio"):
        assert llm.recompute_ratio == 0.5
    msgs = [HumanMessage("hi")]
    with pytest.warns(DeprecationWarning, match="rank as separate arguments"):
        options = llm._request(msgs, None, None, {"reuse": "kvcmas", "rank": 4})[1]["reuse_options"]
    assert options == ReuseOptions("kvcmas", 0.5, 4, "chain")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="recompute_ratio"):
        ChatKVCMAS(recompute_ratio=2.0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="both in reuse and as separate"):
        ChatKVCMAS(reuse=ReuseOptions(rank=8), rank=4)


def test_token_counting_uses_the_chat_template(llm):
    msgs = [SystemMessage("sys"), HumanMessage("hello there")]
    expected = llm.engine.count_tokens([{"role": "system", "content": "sys"},
                                        {"role": "user", "content": "hello there"}])
    assert llm.get_num_tokens_from_messages(msgs) == expected
    assert llm.get_num_tokens_from_messages(msgs, tools=[add]) > expected


async def test_concurrent_calls_from_one_instance(llm):
    outs = await asyncio.gather(*(llm.bind(max_tokens=4).ainvoke(f"Count to {n}.") for n in range(3)))
    assert all(o.usage_metadata["output_tokens"] >= 1 for o in outs)


def test_invalid_tool_calls_stay_invalid_once_stream_chunks_merge():
    cut = InvalidToolCall("call_1", "add", '{"name": "add", "arguments": {"a', "invalid JSON")
    unknown = InvalidToolCall("call_2", "mul", '{"a": 1}', "unknown tool 'mul'")
    not_object = InvalidToolCall("call_3", "add", "[1, 2]", "arguments must be a JSON object")
    out = RequestOutput("r", "a", "", [], "length", 0.0, 0.0, Usage(), invalid_tool_calls=[cut, unknown, not_object])
    whole = ai_message(out, "m")
    merged = AIMessageChunk(content="") + final_chunk("", out, "m")
    assert whole.tool_calls == merged.tool_calls == []
    assert [c["args"] for c in whole.invalid_tool_calls] == [c["args"] for c in merged.invalid_tool_calls] == [
        '<tool_call>{"name": "add", "arguments": {"a', '<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>',
        "[1, 2]"]


# --- LangChain conventions ---------------------------------------------------------------------------
def test_token_ids_come_from_the_models_tokenizer(llm):
    text = "Tokenizers split words like internationalization."
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_token_ids(text) == ids and llm.get_num_tokens(text) == len(ids) > 0
    assert ChatKVCMAS(engine=llm.engine, custom_get_token_ids=lambda t: [1, 2]).get_num_tokens(text) == 2


def test_constructor_arguments_map_warn_or_raise():
    llm = ChatKVCMAS(model_name="smollm2-135m-instruct", num_predict=5, stop_sequences=["x"])
    assert (llm.model, llm.max_tokens, llm.stop) == ("smollm2-135m-instruct", 5, ["x"])
    assert ChatKVCMAS(max_completion_tokens=7).max_tokens == 7
    with pytest.warns(UserWarning, match=r"\['max_retries', 'timeout'\] has no effect"):
        assert ChatKVCMAS(timeout=3, max_retries=2).max_tokens == 256
    with pytest.raises(ValueError, match=r"unexpected arguments \['mirostat'\]"):
        ChatKVCMAS(mirostat=1)
    assert ChatKVCMAS(frequency_penalty=0.5).frequency_penalty == 0.5      # a ChatOpenAI field, here too
    with pytest.raises(ValueError, match="alias 'num_predict'"):
        ChatKVCMAS(max_tokens=4, num_predict=5)


def test_dumpd_and_loads_round_trip(llm):
    for reuse in ("prefix", ReuseOptions("kvcmas", 0.3, 16, "chain")):
        original = ChatKVCMAS(engine=llm.engine, max_tokens=9, stop=["\n"], agent="writer", reuse=reuse, seed=3)
        data = dumpd(original)
        assert data["id"] == ["kvcmas_agents", "integrations", "langchain", "ChatKVCMAS"]
        assert "engine" not in data["kwargs"]
        loaded = loads(json.dumps(data), valid_namespaces=["kvcmas_agents"], allowed_objects=[ChatKVCMAS])
        assert isinstance(loaded, ChatKVCMAS) and loaded.engine is None and loaded.reuse == reuse
        assert loaded.model_dump(exclude={"engine"}) == original.model_dump(exclude={"engine"})


def test_cache_read_is_the_kv_kept_as_is():
    usage = Usage(prompt_tokens=100, completion_tokens=1, cached_tokens=10, reused_tokens=60, recomputed_tokens=15,
                  kept_tokens=55)
    message = ai_message(RequestOutput("r", "a", "", [], "stop", 0.0, 0.0, usage, reuse="kvcmas"), "m")
    assert message.usage_metadata["input_token_details"]["cache_read"] == 55
    meta = message.response_metadata
    assert (meta["cached_tokens"], meta["reused_tokens"], meta["recomputed_tokens"]) == (10, 60, 15)
