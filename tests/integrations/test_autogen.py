"""KVCMASClient with real AutoGen agents and teams on the real default model."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import ModelClientStreamingChunkEvent, ToolCallExecutionEvent, ToolCallRequestEvent
from autogen_agentchat.teams import DiGraphBuilder, GraphFlow, RoundRobinGroupChat, SelectorGroupChat
from autogen_core import AgentId, CancellationToken, FunctionCall, Image, MessageHandlerContext
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import (
    AssistantMessage, ChatCompletionClient, CreateResult, FunctionExecutionResult, FunctionExecutionResultMessage,
    SystemMessage, UserMessage,
)
from autogen_core.tools import FunctionTool
from PIL import Image as PILImage
from pydantic import BaseModel

from kvcmas_agents import Engine, EngineConfig, ReuseOptions, registry
from kvcmas_agents.engine.outputs import RequestOutput, Usage
from kvcmas_agents.chat.tools import InvalidToolCall, ToolCall
from kvcmas_agents.integrations import KVCMASClient, register_team
from kvcmas_agents.integrations import autogen as autogen_module
from kvcmas_agents.integrations._autogen_convert import clean_json, to_create_result, to_engine_messages
from kvcmas_agents.integrations._autogen_team import current_agent_name, team_edges
from kvcmas_agents.chat.tool_filter import ToolBlockFilter

HELLO = [SystemMessage(content="You are a helpful assistant."),
         UserMessage(content="Say hello in one short sentence.", source="user")]


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"Sunny in {city}"


def echo(text: str) -> str:
    """Return the text."""
    return text


WEATHER = FunctionTool(get_weather, description="Get the current weather for a city.")


def weather_history() -> list:
    """A few-shot history of weather questions answered with tool calls, which greedy decoding copies."""
    hist: list = []
    for i, city in enumerate(["Paris", "Rome", "Berlin"]):
        hist += [UserMessage(content=f"Weather in {city}?", source="user"),
                 AssistantMessage(content=[FunctionCall(id=f"call_{i}", name="get_weather",
                                                        arguments=json.dumps({"city": city}))], source="bot"),
                 FunctionExecutionResultMessage(content=[
                     FunctionExecutionResult(content=f"Sunny in {city}", name="get_weather", call_id=f"call_{i}")]),
                 AssistantMessage(content=f"It is sunny in {city}.", source="bot")]
    return hist


@pytest.fixture(scope="module")
def engine(engine_prefix):
    return engine_prefix


@pytest.fixture(scope="module")
def kvcmas_engine():
    """A fresh engine in cross-agent reuse mode, for the reuse tests."""
    engine = Engine(EngineConfig(reuse="kvcmas"))
    yield engine
    engine.close()


@pytest.fixture
def client(engine):
    return KVCMASClient(engine=engine, max_tokens=12)


async def wait_idle(engine, timeout: float = 10.0) -> dict:
    """Poll until no request holds KV blocks; returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats["memory"]["blocks_in_use"] == 0 and stats["counters"]["num_running"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def agent_stats(engine, name: str) -> dict:
    return dict(engine.stats()["agents"].get(name, {}))


def well_formed(call: FunctionCall) -> bool:
    return bool(call.id) and bool(call.name) and isinstance(json.loads(call.arguments), dict)


# --- the client on its own ------------------------------------------------------------------------
async def test_create_returns_text_and_usage(client, engine):
    before = agent_stats(engine, "solo").get("requests", 0)
    result = await client.create(HELLO, extra_create_args={"agent": "solo"})
    assert isinstance(result, CreateResult)
    assert isinstance(result.content, str) and result.content
    assert result.finish_reason in ("stop", "length") and result.cached is False
    assert result.usage.prompt_tokens == client.count_tokens(HELLO)
    assert 0 < result.usage.completion_tokens <= 12
    assert client.total_usage() == client.actual_usage() == result.usage
    assert client.remaining_tokens(HELLO) == engine.max_context - result.usage.prompt_tokens
    assert agent_stats(engine, "solo")["requests"] == before + 1


async def test_create_stream_yields_chunks_then_one_result(client):
    items = [item async for item in client.create_stream(HELLO, extra_create_args={"max_tokens": 8})]
    *chunks, result = items
    assert chunks and all(isinstance(c, str) for c in chunks)
    assert isinstance(result, CreateResult) and result.content == "".join(chunks)
    assert result.usage.completion_tokens <= 8


async def test_agent_name_precedence(engine):
    named = KVCMASClient(engine=engine, agent="explicit")
    assert named._prepare(HELLO, [], "auto", None, {}).agent == "explicit"
    with MessageHandlerContext.populate_context(AgentId("coder_team42", "team42")):
        assert current_agent_name() == "coder"
        assert named._prepare(HELLO, [], "auto", None, {}).agent == "coder"
        assert named._prepare(HELLO, [], "auto", None, {"agent": "override"}).agent == "override"
    with MessageHandlerContext.populate_context(AgentId("tester", "default")):
        assert current_agent_name() == "tester"
    assert current_agent_name() is None
    assert KVCMASClient(engine=engine)._prepare(HELLO, [], "auto", None, {}).agent == "default"


def test_clients_share_one_engine_per_model(engine, monkeypatch):
    monkeypatch.setattr(registry, "_engines", {"smollm2-135m-instruct": engine})
    monkeypatch.setattr(registry, "_holders", {})
    a, b = KVCMASClient(), KVCMASClient("SmolLM2-135M-Instruct")
    assert a.engine is b.engine is engine
    other = SimpleNamespace(config=SimpleNamespace(model="elsewhere"))   # an explicit engine wins
    pinned = KVCMASClient(engine=other)
    assert pinned.engine is other and pinned._to_config().model == "elsewhere"


async def test_close_releases_the_shared_engine_after_its_last_client(monkeypatch):
    for name, fresh in (("_engines", {}), ("_holders", {}), ("_kept", set())):
        monkeypatch.setattr(registry, name, fresh)
    a, b = KVCMASClient(max_tokens=2), KVCMASClient(max_tokens=2)
    engine = a.engine
    assert b.engine is engine and (await b.create(HELLO)).usage.completion_tokens > 0
    await a.close()
    assert not engine._closed and (await b.create(HELLO)).usage.completion_tokens > 0
    await b.close()
    await b.close()                       # idempotent
    assert engine._closed and registry._engines == {}
    with pytest.raises(RuntimeError, match="closed"):
        await a.create(HELLO)


async def test_close_leaves_an_explicit_engine_open(engine):
    client = KVCMASClient(engine=engine, max_tokens=2)
    await client.close()
    assert not engine._closed


def test_model_info_and_bad_arguments(client):
    info = client.model_info
    assert info["vision"] is False and info["function_calling"] and info["json_output"]
    assert info["structured_output"] is True and info["family"] == "unknown"
    assert client.capabilities["function_calling"] is True
    with pytest.raises(ValueError, match="extra_create_args"):
        client._prepare(HELLO, [], "auto", None, {"best_of": 2})
    other = FunctionTool(echo, description="Echo.")
    with pytest.raises(ValueError, match="not in tools"):
        client._prepare(HELLO, [WEATHER], other, None, {})
    with pytest.raises(ValueError):
        KVCMASClient(temperature=-1)


async def test_multimodal_user_message_is_rejected(client):
    image = Image.from_pil(PILImage.new("RGB", (4, 4)))
    with pytest.raises(ValueError, match="multimodal content is not supported"):
        await client.create([UserMessage(content=["What is this?", image], source="user")])
    assert to_engine_messages([UserMessage(content=["a", "b"], source="u")])[0]["content"] == "a\nb"


def test_component_round_trip(engine):
    original = KVCMASClient("smollm2-135m-instruct", engine=engine, temperature=0.5, max_tokens=32, top_k=5,
                            seed=7, stop=["END"], agent="writer", reuse=ReuseOptions("naive", 0.2, 8, "chain"))
    dumped = original.dump_component()
    assert dumped.component_type == "model"
    assert dumped.provider == "kvcmas_agents.integrations.autogen.KVCMASClient"
    loaded = ChatCompletionClient.load_component(dumped)
    assert isinstance(loaded, KVCMASClient)
    assert loaded._to_config() == original._to_config()
    assert loaded._reuse == ReuseOptions("naive", 0.2, 8, "chain")
    assert loaded.dump_component() == dumped
    assert loaded._engine is None     # the engine instance is not serialized; loading is lazy
    # Through an agent's config as well.
    agent = AssistantAgent("writer", model_client=original)
    again = AssistantAgent.load_component(agent.dump_component())
    assert again._model_client._to_config().max_tokens == 32


def test_shared_engine_is_created_with_kvcmas_unless_reuse_is_set(engine, monkeypatch):
    created: list[tuple] = []
    monkeypatch.setattr(autogen_module, "get_engine", lambda model, **kw: created.append((model, kw)) or engine)
    monkeypatch.setattr(autogen_module, "hold_engine", lambda model, **kw: created.append((model, kw)) or engine)
    assert KVCMASClient().engine is engine
    assert KVCMASClient("other-model", reuse="prefix").engine is engine
    register_team(RoundRobinGroupChat([AssistantAgent("a", model_client=KVCMASClient(engine=engine)),
                                       AssistantAgent("b", model_client=KVCMASClient(engine=engine))]), "m")
    assert created == [(None, {"reuse": "kvcmas"}), ("other-model", {"reuse": "prefix"}), ("m", {"reuse": "kvcmas"})]


def test_reuse_knobs_reach_each_request(engine):
    client = KVCMASClient(engine=engine, reuse=ReuseOptions("naive", rank=4))
    assert client._prepare(HELLO, [], "auto", None, {}).reuse_options == ReuseOptions("naive", None, 4, None)
    # per call, knob by knob: a mode's name replaces only the mode
    per_call = client._prepare(HELLO, [], "auto", None, {"reuse": ReuseOptions("kvcmas", recompute_ratio=0.5)})
    assert per_call.reuse_options == ReuseOptions("kvcmas", 0.5, 4, None)
    assert client._prepare(HELLO, [], "auto", None, {"reuse": "prefix"}).reuse_options == ReuseOptions("prefix", rank=4)
    assert KVCMASClient(reuse="naive")._to_config().reuse == "naive"
    with pytest.raises(ValueError, match="reuse must be"):
        KVCMASClient(reuse="everything")
    with pytest.raises(ValueError, match="reference"):
        client._prepare(HELLO, [], "auto", None, {"reuse": ReuseOptions(reference="nowhere")})


def test_the_separate_reuse_knobs_still_work_with_a_deprecation_warning(engine):
    with pytest.warns(DeprecationWarning, match="rank as separate arguments"):
        client = KVCMASClient(engine=engine, reuse="naive", rank=4)
    assert client._reuse == ReuseOptions("naive", None, 4, None)
    with pytest.warns(DeprecationWarning, match="recompute_ratio as separate arguments"):
        per_call = client._prepare(HELLO, [], "auto", None, {"reuse": "kvcmas", "recompute_ratio": 0.5})
    assert per_call.reuse_options == ReuseOptions("kvcmas", 0.5, 4, None)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="reference"):
        client._prepare(HELLO, [], "auto", None, {"reference": "nowhere"})
    # a component saved with the separate fields loads into the one setting
    old = {"provider": "kvcmas_agents.integrations.autogen.KVCMASClient", "component_type": "model",
           "config": {"reuse": "naive", "recompute_ratio": 0.2, "rank": 8, "reference": "chain"}}
    with pytest.warns(DeprecationWarning, match="KVCMASClientConfig"):
        loaded = ChatCompletionClient.load_component(old)
    assert loaded._reuse == ReuseOptions("naive", 0.2, 8, "chain")
    assert loaded._to_config().reuse == ReuseOptions("naive", 0.2, 8, "chain") and loaded._to_config().rank is None


async def test_openai_penalties_and_logit_bias_as_in_the_openai_client(engine):
    client = KVCMASClient(engine=engine, max_tokens=3, frequency_penalty=0.5, logit_bias={"7": -100})
    prepared = client._prepare(HELLO, [], "auto", None, {"presence_penalty": -1.0})
    s = prepared.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias) == (0.5, -1.0, {7: -100})
    assert client._to_config().logit_bias == {7: -100}
    assert ChatCompletionClient.load_component(client.dump_component())._to_config() == client._to_config()
    with pytest.raises(ValueError, match="frequency_penalty"):
        KVCMASClient(engine=engine, frequency_penalty=3)
    with pytest.raises(ValueError, match="logit_bias"):
        client._prepare(HELLO, [], "auto", None, {"logit_bias": {1: 500}})
    plain = KVCMASClient(engine=engine, max_tokens=3)
    await plain.create(HELLO)
    first = plain.last_output.token_ids[0]
    await plain.create(HELLO, extra_create_args={"logit_bias": {first: -100}})
    assert plain.last_output.token_ids[0] != first


# --- conversion units -----------------------------------------------------------------------------
def test_message_conversion_with_tool_calls():
    msgs = to_engine_messages([
        AssistantMessage(content=[FunctionCall(id="c1", name="f", arguments='{"x": 1}'),
                                  FunctionCall(id="c2", name="g", arguments="not json")], thought="thinking",
                         source="a"),
        FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="1", name="f", call_id="c1"),
                                                FunctionExecutionResult(content="2", name="g", call_id="c2")]),
    ])
    assert msgs[0]["role"] == "assistant" and msgs[0]["content"] == "thinking"
    assert [c["id"] for c in msgs[0]["tool_calls"]] == ["c1", "c2"]
    assert msgs[0]["tool_calls"][1]["function"]["arguments"] == {"raw_arguments": "not json"}
    assert msgs[1:] == [{"role": "tool", "content": "1", "tool_call_id": "c1"},
                        {"role": "tool", "content": "2", "tool_call_id": "c2"}]


def _output(text: str, content: str, calls=(), invalid=(), reason: str = "stop") -> RequestOutput:
    return RequestOutput(request_id="r", agent="a", text=text, token_ids=[], finish_reason=reason, ttft_s=0.0,
                         latency_s=0.0, usage=Usage(prompt_tokens=10, completion_tokens=5), content=content,
                         tool_calls=list(calls), invalid_tool_calls=list(invalid))


def test_request_output_to_create_result():
    out = _output('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                  "Let me check.", [ToolCall("call_x", "get_weather", {"city": "Oslo"})], reason="tool_calls")
    result = to_create_result(out)
    assert result.finish_reason == "function_calls" and result.thought == "Let me check."
    assert result.content == [FunctionCall(id="call_x", arguments='{"city": "Oslo"}', name="get_weather")]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (10, 5)

    bad = _output("<tool_call>{oops</tool_call>", "", invalid=[InvalidToolCall("c", None, "{oops", "bad")])
    assert to_create_result(bad).content == "<tool_call>{oops</tool_call>"
    assert to_create_result(_output("x", "x", reason="length")).finish_reason == "length"


def test_json_cleaning_is_best_effort():
    class Answer(BaseModel):
        city: str

    assert clean_json('Sure:\n```json\n{"city": "Oslo"}\n```', Answer) == '{"city":"Oslo"}'
    assert json.loads(clean_json('Here {"a": 1} you go', True)) == {"a": 1}
    assert clean_json("no json here", Answer) == "no json here"
    assert clean_json('{"town": "Oslo"}', Answer) == '{"town": "Oslo"}'
    two = '```json\n{"town": "Oslo"}\n```\nor\n```json\n{"city": "Bergen"}\n```'
    assert clean_json(two, Answer) == '{"city":"Bergen"}'     # the first fenced object that validates
    assert clean_json('```text\n{"city": "Oslo"}\n```', Answer) == '{"city":"Oslo"}'


def test_tool_block_filter_hides_call_blocks():
    hold = ToolBlockFilter()
    shown = [hold.push(t) for t in ["Let me", " check <", "tool_", "call>{\"name\"", ": 1}</tool_call>"]]
    assert "".join(shown) + hold.flush() == "Let me check "
    plain = ToolBlockFilter()
    assert plain.push("a <b") == "a <b" and plain.push(" <to") == " " and plain.flush() == "<to"
    cut = ToolBlockFilter()
    assert cut.push("x <tool_call>{\"name\": ") == "x " and cut.flush() == ""     # a cut-off block stays hidden


# --- tool calls on the real model -----------------------------------------------------------------
async def test_tool_call_from_few_shot_history(engine):
    client = KVCMASClient(engine=engine, max_tokens=32)
    messages = [SystemMessage(content="You are a weather bot. Always answer by calling get_weather."),
                *weather_history(), UserMessage(content="Weather in London?", source="user")]
    result = await client.create(messages, tools=[WEATHER])
    assert result.finish_reason == "function_calls", result
    [call] = result.content
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "London"} and call.id

    items = [item async for item in client.create_stream(messages, tools=[WEATHER])]
    assert all("<tool_call>" not in i for i in items[:-1])
    assert items[-1].finish_reason == "function_calls" and items[-1].content[0].name == "get_weather"


async def test_stream_of_a_cut_off_tool_call_adds_up_to_the_create_result(engine):
    client = KVCMASClient(engine=engine, max_tokens=8)     # stops inside the <tool_call> block
    messages = [SystemMessage(content="You are a weather bot. Always answer by calling get_weather."),
                *weather_history(), UserMessage(content="Weather in London?", source="user")]
    created = await client.create(messages, tools=[WEATHER])
    assert created.finish_reason == "length" and created.content.startswith("<tool_call>"), created
    *chunks, result = [item async for item in client.create_stream(messages, tools=[WEATHER])]
    assert (result.finish_reason, result.content) == (created.finish_reason, created.content)
    assert "".join(chunks) == result.content


async def test_a_forced_call_cut_by_max_tokens_is_text(engine):
    client = KVCMASClient(engine=engine, max_tokens=22)     # stops inside the arguments
    messages = [UserMessage(content="Weather in London?", source="user")]
    created = await client.create(messages, tools=[WEATHER], tool_choice="required")
    assert created.finish_reason == "length"
    assert created.content.startswith('<tool_call>{"name": "get_weather", "arguments": {'), created


class City(BaseModel):
    name: str
    country: str


CAPITAL = [UserMessage(content="What is the capital of France?", source="user")]


async def test_json_output_is_constrained_to_the_model_schema(engine):
    client = KVCMASClient(engine=engine, max_tokens=48)
    result = await client.create(CAPITAL, json_output=City)
    assert result.finish_reason == "stop" and City.model_validate_json(result.content).name == "Paris"
    result = await client.create(HELLO, json_output=True)
    assert result.finish_reason == "stop" and isinstance(json.loads(result.content), dict)


async def test_assistant_agent_structured_output(engine):
    agent = AssistantAgent("geo", model_client=KVCMASClient(engine=engine, max_tokens=48), output_content_type=City)
    result = await agent.run(task="What is the capital of France?")
    assert isinstance(result.messages[-1].content, City) and result.messages[-1].content.name == "Paris"


async def test_agents_run_alone_are_accounted_by_their_names(engine):
    client = KVCMASClient(engine=engine, max_tokens=4, agent="fallback")
    before = {n: agent_stats(engine, n).get("requests", 0) for n in ("scout", "scribe", "fallback")}
    await AssistantAgent("scout", model_client=client).run(task="Name a colour.")
    events = [e async for e in AssistantAgent("scribe", model_client=client, model_client_stream=True,
                                                  tools=[WEATHER]).run_stream(task="Name a city.")]
    assert isinstance(events[-1], TaskResult)
    after = {n: agent_stats(engine, n).get("requests", 0) for n in before}
    assert after["scout"] - before["scout"] >= 1 and after["scribe"] - before["scribe"] >= 1
    assert after["fallback"] == before["fallback"]
    await client.create(HELLO)             # no agent calling: the client's own name
    assert agent_stats(engine, "fallback")["requests"] == before["fallback"] + 1


# --- real teams -----------------------------------------------------------------------------------
async def test_round_robin_team_reports_participant_names(engine):
    client = KVCMASClient(engine=engine, max_tokens=12)
    names = ["planner", "coder", "reviewer"]
    agents = [AssistantAgent(n, model_client=client, system_message=f"You are the {n}. Be brief.",
                             model_client_stream=True) for n in names]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(4))
    edges = register_team(team)
    assert edges == [("planner", "coder"), ("coder", "reviewer"), ("reviewer", "planner")]
    assert engine.stats()["edges"] == edges
    before = {n: agent_stats(engine, n) for n in names}

    events = [e async for e in team.run_stream(task="Plan a tiny hello-world script.")]
    assert isinstance(events[-1], TaskResult) and len(events[-1].messages) == 4
    assert {e.source for e in events if isinstance(e, ModelClientStreamingChunkEvent)} == set(names)

    after = engine.stats()["agents"]
    assert set(names) <= set(after)
    delta = {n: {k: after[n][k] - before[n].get(k, 0) for k in ("requests", "prompt_tokens", "completion_tokens")}
             for n in names}
    assert all(d["requests"] == 1 and d["completion_tokens"] > 0 for d in delta.values())
    # Each later agent sees its predecessors' messages, so its prompt is longer.
    assert delta["planner"]["prompt_tokens"] < delta["coder"]["prompt_tokens"] < delta["reviewer"]["prompt_tokens"]


async def run_round_robin(client: KVCMASClient, engine, task: str) -> dict[str, dict[str, float]]:
    """planner -> coder -> reviewer, one turn each; returns each agent's change in engine stats."""
    names = ["planner", "coder", "reviewer"]
    agents = [AssistantAgent(n, model_client=client, system_message=f"You are the {n}. Be brief.") for n in names]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(4))
    register_team(team)
    before = engine.stats()["agents"]
    result = await team.run(task=task)
    assert [m.source for m in result.messages] == ["user", *names]
    after = engine.stats()["agents"]
    keys = ("requests", "reused_tokens", "recomputed_tokens")
    return {n: {k: after[n][k] - before.get(n, {}).get(k, 0) for k in keys} for n in names}


async def test_round_robin_later_agents_reuse_earlier_agents_kv(kvcmas_engine):
    client = KVCMASClient(engine=kvcmas_engine, max_tokens=12)
    delta = await run_round_robin(client, kvcmas_engine, "Plan a tiny hello-world script.")
    assert all(d["requests"] == 1 for d in delta.values())
    # Every agent sees the others' messages as user turns rendered alike: the coder reuses the task
    # the planner prefilled; the reviewer also reuses the planner's reply, which the coder prefilled.
    assert 0 < delta["coder"]["reused_tokens"] < delta["reviewer"]["reused_tokens"]
    assert all(d["recomputed_tokens"] <= d["reused_tokens"] for d in delta.values())
    last = client.last_output
    assert last.agent == "reviewer" and last.reuse == "kvcmas"
    assert last.usage.reused_tokens == delta["reviewer"]["reused_tokens"]


async def test_register_team_declares_system_prompts_with_tools(kvcmas_engine):
    """Every participant's system message (the coder's with its tool instructions) is declared: each
    first call finds its own prefix computed, and the coder and reviewer get the shared history
    corrected ahead of time by their predecessor."""
    client = KVCMASClient(engine=kvcmas_engine, max_tokens=12)
    names = ["planner", "coder", "reviewer"]
    agents = [AssistantAgent(n, model_client=client, tools=[WEATHER] if n == "coder" else None,
                             system_message=f"You are the {n} of the declared team. Be brief.") for n in names]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(4))
    before = kvcmas_engine.stats()
    ahead = dict(before["reuse"]["kvcmas"]["prefetch"]["by_agent"])
    register_team(team)
    assert kvcmas_engine.stats()["counters"]["declared"] - before["counters"]["declared"] == 3
    result = await team.run(task="Plan a tiny script that prints the weather.")
    assert [m.source for m in result.messages][:2] == ["user", "planner"]
    after = kvcmas_engine.stats()
    cached = {n: after["agents"][n]["cached_tokens"] - before["agents"].get(n, {}).get("cached_tokens", 0)
              for n in names}
    assert all(c > 0 for c in cached.values()), cached
    by_agent = after["reuse"]["kvcmas"]["prefetch"]["by_agent"]
    assert all(by_agent.get(n, 0) > ahead.get(n, 0) for n in ("coder", "reviewer")), by_agent


async def test_round_robin_with_explicit_prefix_reuse_reuses_nothing(kvcmas_engine):
    client = KVCMASClient(engine=kvcmas_engine, max_tokens=12, reuse="prefix")
    delta = await run_round_robin(client, kvcmas_engine, "Plan a tiny goodbye-world script.")
    assert all(d["requests"] == 1 and d["reused_tokens"] == 0 for d in delta.values())
    assert client.last_output.reuse == "prefix" and client.last_output.usage.reused_tokens == 0


async def test_graphflow_team_edges_and_run(engine):
    client = KVCMASClient(engine=engine, max_tokens=8)
    writer, editor, summarizer = (AssistantAgent(n, model_client=client, system_message=f"You are the {n}.")
                                  for n in ("writer", "editor", "summarizer"))
    graph = DiGraphBuilder().add_node(writer).add_node(editor).add_node(summarizer) \
        .add_edge(writer, editor).add_edge(editor, summarizer).build()
    flow = GraphFlow([writer, editor, summarizer], graph=graph)
    assert register_team(flow, engine) == [("writer", "editor"), ("editor", "summarizer")]
    assert engine.stats()["edges"] == [("writer", "editor"), ("editor", "summarizer")]

    result = await flow.run(task="Write one line about caches.")
    assert [m.source for m in result.messages] == ["user", "writer", "editor", "summarizer"]
    assert {"writer", "editor", "summarizer"} <= set(engine.stats()["agents"])


def test_selector_team_edges_follow_participant_order(engine):
    client = KVCMASClient(engine=engine)
    agents = [AssistantAgent(n, model_client=client) for n in ("a", "b")]
    team = SelectorGroupChat(agents, model_client=client)
    assert register_team(team) == [("a", "b"), ("b", "a")]
    assert engine.stats()["edges"] == [("a", "b"), ("b", "a")]


def test_team_edges_for_a_team_autogen_cannot_serialize():
    # team.dump_component() fails on a tool whose source cannot be read; the speaking order does not need it.
    namespace: dict = {}
    exec("def shout(text: str) -> str:\n    'Shout.'\n    return text.upper()", namespace)
    client = KVCMASClient()             # its shared engine is only made on first use, and none is needed here
    agents = [AssistantAgent("a", model_client=client, tools=[FunctionTool(namespace["shout"], "Shout.")]),
              AssistantAgent("b", model_client=client)]
    team = RoundRobinGroupChat(agents)
    with pytest.raises(OSError):
        team.dump_component()
    assert team_edges(team) == [("a", "b"), ("b", "a")]
    with pytest.raises(TypeError, match="group chat team"):
        team_edges(SimpleNamespace())


async def test_tool_agent_in_team_run_stream(engine):
    client = KVCMASClient(engine=engine, max_tokens=32)
    context = UnboundedChatCompletionContext(initial_messages=weather_history())
    agent = AssistantAgent("forecaster", model_client=client, tools=[WEATHER], model_context=context,
                           system_message="You are a weather bot. Always answer by calling get_weather.",
                           model_client_stream=True)
    team = RoundRobinGroupChat([agent], termination_condition=MaxMessageTermination(2))
    events = [e async for e in team.run_stream(task="Weather in London?")]
    assert isinstance(events[-1], TaskResult)
    calls = [c for e in events if isinstance(e, ToolCallRequestEvent) for c in e.content]
    assert all(well_formed(c) and c.name == "get_weather" for c in calls)
    if calls:
        results = [r for e in events if isinstance(e, ToolCallExecutionEvent) for r in e.content]
        assert [r.call_id for r in results] == [c.id for c in calls]
        assert not any(r.is_error for r in results)
    assert "forecaster" in engine.stats()["agents"]


async def test_assistant_agent_calls_its_tool_with_tool_choice_left_auto(engine):
    """The decision step (the client's default) makes the agent call its tool; without it, it answers."""
    task = "What is the weather in Paris?"
    agent = AssistantAgent("weather", model_client=KVCMASClient(engine=engine, max_tokens=48), tools=[WEATHER])
    result = await agent.run(task=task)
    calls = [c for m in result.messages if isinstance(m, ToolCallRequestEvent) for c in m.content]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    done = [r for m in result.messages if isinstance(m, ToolCallExecutionEvent) for r in m.content]
    assert [(r.content, r.is_error) for r in done] == [("Sunny in Paris", False)]
    free = AssistantAgent("weather_free", model_client=KVCMASClient(engine=engine, max_tokens=48,
                                                                    tool_call_threshold=None), tools=[WEATHER])
    free_result = await free.run(task=task)
    assert not any(isinstance(m, ToolCallRequestEvent) for m in free_result.messages)


# --- cancellation -------------------------------------------------------------------------------
async def test_cancelled_team_run_leaves_engine_serving(engine):
    client = KVCMASClient(engine=engine, max_tokens=200, temperature=0.8, seed=1)
    agents = [AssistantAgent(n, model_client=client, model_client_stream=True) for n in ("talker", "listener")]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(6))
    aborted = engine.stats()["counters"]["aborted"]
    token = CancellationToken()
    with pytest.raises(asyncio.CancelledError):
        async for event in team.run_stream(task="Tell me a long story about a lighthouse.",
                                           cancellation_token=token):
            if isinstance(event, ModelClientStreamingChunkEvent):
                token.cancel()
    stats = await wait_idle(engine)
    assert stats["memory"]["blocks_in_use"] == 0 and stats["counters"]["num_running"] == 0
    assert stats["counters"]["aborted"] == aborted + 1

    result = await KVCMASClient(engine=engine, max_tokens=4).create(HELLO)
    assert result.usage.completion_tokens > 0


async def test_cancelled_create_aborts_engine_request(engine):
    client = KVCMASClient(engine=engine, max_tokens=200, temperature=0.8, seed=2)
    aborted = engine.stats()["counters"]["aborted"]
    token = CancellationToken()
    task = asyncio.ensure_future(client.create(HELLO, cancellation_token=token))
    deadline = time.monotonic() + 10
    while engine.stats()["counters"]["num_running"] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)        # cancelled once it runs, however fast the engine decodes
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_idle(engine)
    assert stats["memory"]["blocks_in_use"] == 0 and stats["counters"]["aborted"] == aborted + 1
