"""Real LangGraph graphs on the real default model through ChatKVCMAS."""
from __future__ import annotations

import operator
from typing import Annotated, Any, Literal, TypedDict

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Send

from kvcmas_agents import Engine, EngineConfig, registry
from kvcmas_agents.integrations.langchain import ChatKVCMAS
from kvcmas_agents.integrations.langgraph import graph_edges, register_graph

ROLES = {"planner": "You plan the work in short steps.", "coder": "You write Python code.",
         "reviewer": "You review code briefly."}


@pytest.fixture(scope="module")
def engine():
    """A fresh engine so that stats and edges belong to these tests only."""
    engine = Engine(EngineConfig(reuse="prefix"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def kvcmas_engine():
    """A fresh engine in cross-agent reuse mode, for the reuse tests."""
    engine = Engine(EngineConfig(reuse="kvcmas"))
    yield engine
    engine.close()


def pipeline(llm: ChatKVCMAS, sync: bool = False, roles: dict[str, str] = ROLES,
             models: dict[str, Any] | None = None) -> StateGraph:
    """planner -> coder -> reviewer, each node with its own system prompt over the shared messages
    (``models`` replaces ``llm`` in some nodes, e.g. one bound to tools)."""
    def make(name: str):
        model = (models or {}).get(name, llm)

        def prompt(state: MessagesState) -> list:
            return [SystemMessage(roles[name]), *state["messages"]]

        def node_sync(state: MessagesState) -> dict:
            return {"messages": [model.invoke(prompt(state))]}

        async def node(state: MessagesState) -> dict:
            return {"messages": [await model.ainvoke(prompt(state))]}
        return node_sync if sync else node

    graph = StateGraph(MessagesState)
    for name in ROLES:
        graph.add_node(name, make(name))
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "coder")
    graph.add_edge("coder", "reviewer")
    graph.add_edge("reviewer", END)
    return graph


# --- edges (no model) ---------------------------------------------------------------------------
class Fan(TypedDict):
    topic: str
    notes: Annotated[list[str], operator.add]


def _noop(state: dict) -> dict:
    return {}


def test_graph_edges_cover_plain_conditional_waiting_and_send_edges():
    def route(state: Fan) -> Literal["coder", "reviewer"]:
        return "coder"

    def fan(state: Fan) -> list[Send]:
        return [Send("expert", state)]

    g = StateGraph(Fan)
    for name in ("planner", "coder", "reviewer", "expert", "summarizer"):
        g.add_node(name, _noop)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", route)                      # targets from the Literal
    g.add_conditional_edges("coder", fan, ["expert"])               # Send fan-out with a path map
    g.add_edge(["expert", "reviewer"], "summarizer")                 # waiting edge
    g.add_edge("summarizer", END)
    expected = [("planner", "coder"), ("planner", "reviewer"), ("coder", "expert"),
                ("reviewer", "summarizer"), ("expert", "summarizer")]
    assert graph_edges(g.compile()) == expected
    assert graph_edges(g) == expected


def test_send_without_path_map_records_what_is_visible():
    g = StateGraph(Fan)
    for name in ("planner", "expert", "summarizer"):
        g.add_node(name, _noop)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: [Send("expert", s)])
    g.add_edge("expert", "summarizer")
    assert graph_edges(g.compile()) == [("expert", "summarizer")]


def test_register_graph_accepts_engine_model_or_chat_model(engine):
    compiled = pipeline(ChatKVCMAS(engine=engine)).compile()
    expected = [("planner", "coder"), ("coder", "reviewer")]
    assert register_graph(compiled, engine) == expected
    assert register_graph(compiled, ChatKVCMAS(engine=engine)) == expected
    assert engine.stats()["edges"] == expected and engine.predecessors("reviewer") == ["coder"]
    with pytest.raises(TypeError):
        register_graph(compiled, 42)


# --- graphs on the real model ------------------------------------------------------------------
async def test_pipeline_agents_edges_reuse_and_usage(engine):
    llm = ChatKVCMAS(engine=engine, max_tokens=16)
    compiled = pipeline(llm).compile()
    register_graph(compiled, engine)
    task = {"messages": [HumanMessage("Write a function that reverses a string.")]}
    first = await compiled.ainvoke(task)
    replies = first["messages"][1:]
    assert [m.response_metadata["agent"] for m in replies] == list(ROLES)
    assert all(isinstance(m, AIMessage) and m.usage_metadata["input_tokens"] > 0 for m in replies)
    stats = engine.stats()
    assert set(stats["agents"]) == set(ROLES)
    assert stats["edges"] == [("planner", "coder"), ("coder", "reviewer")]

    second = await compiled.ainvoke(task)          # same prompts again: each agent hits its own cache
    for m in second["messages"][1:]:
        assert m.usage_metadata["input_token_details"]["cache_read"] > 0, m.response_metadata["agent"]
    assert all(engine.stats()["agents"][a]["cached_tokens"] > 0 for a in ROLES)


def test_sync_graph_invoke_and_message_streaming(engine):
    compiled = pipeline(ChatKVCMAS(engine=engine, max_tokens=8), sync=True).compile()
    out = compiled.invoke({"messages": [HumanMessage("Add two numbers.")]})
    assert [m.response_metadata["agent"] for m in out["messages"][1:]] == list(ROLES)

    nodes, finals = [], []
    for chunk, meta in compiled.stream({"messages": [HumanMessage("Add two numbers.")]}, stream_mode="messages"):
        assert isinstance(chunk, AIMessageChunk)
        nodes.append(meta["langgraph_node"])
        if chunk.chunk_position == "last":
            finals.append(chunk)
    assert list(dict.fromkeys(nodes)) == list(ROLES)
    assert len(finals) == 3 and all(c.usage_metadata["output_tokens"] > 0 for c in finals)


async def test_multimodal_content_in_a_graph_raises_value_error(engine):
    compiled = pipeline(ChatKVCMAS(engine=engine, max_tokens=4)).compile()
    image = HumanMessage([{"type": "text", "text": "What is in this picture?"},
                          {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    with pytest.raises(ValueError, match="text-only"):
        await compiled.ainvoke({"messages": [image]})


class Panel(TypedDict):
    question: str
    answers: Annotated[list[str], operator.add]
    summary: str


async def test_send_fanout_branches_batch_in_the_engine():
    engine = Engine(EngineConfig(reuse="prefix"))      # fresh: max_batch_seqs must come from this graph
    try:
        llm = ChatKVCMAS(engine=engine, max_tokens=12)
        experts = ["security", "performance", "testing"]

        def fan_out(state: Panel) -> list[Send]:
            return [Send(f"expert_{e}", state) for e in experts]

        def make_expert(area: str):
            async def expert(state: Panel) -> dict:
                reply = await llm.ainvoke([SystemMessage(f"You are a {area} expert."),
                                           HumanMessage(state["question"])])
                return {"answers": [reply.content]}
            return expert

        async def summarizer(state: Panel) -> dict:
            reply = await llm.ainvoke([SystemMessage("Summarize the answers."),
                                       HumanMessage("\n".join(state["answers"]))])
            return {"summary": reply.content}

        g = StateGraph(Panel)
        for e in experts:
            g.add_node(f"expert_{e}", make_expert(e))
            g.add_edge(f"expert_{e}", "summarizer")
        g.add_node("summarizer", summarizer)
        g.add_conditional_edges(START, fan_out, [f"expert_{e}" for e in experts])
        g.add_edge("summarizer", END)
        compiled = g.compile()
        edges = register_graph(compiled, engine)
        assert edges == [(f"expert_{e}", "summarizer") for e in experts]

        out = await compiled.ainvoke({"question": "How should I store user passwords?", "answers": []})
        assert len(out["answers"]) == 3 and isinstance(out["summary"], str)
        stats = engine.stats()
        assert stats["counters"]["max_batch_seqs"] >= 2
        assert set(stats["agents"]) == {*(f"expert_{e}" for e in experts), "summarizer"}
    finally:
        engine.close()


# --- cross-agent KV reuse --------------------------------------------------------------------------
def agent_deltas(engine: Engine, before: dict, key: str) -> dict[str, float]:
    after = engine.stats()["agents"]
    return {a: after[a][key] - before.get(a, {}).get(key, 0) for a in ROLES}


async def test_default_chat_models_create_a_kvcmas_engine_and_later_agents_reuse(monkeypatch):
    """Default ChatKVCMAS instances on a fresh registry: the engine runs kvcmas, and the coder and
    reviewer reuse the KV of messages that the agents before them prefilled."""
    monkeypatch.setattr(registry, "_engines", {})
    llm = ChatKVCMAS(max_tokens=12)
    engine = llm.get_engine()
    try:
        assert engine.config.reuse == "kvcmas" and engine is registry.get_engine()
        compiled = pipeline(llm).compile()
        assert register_graph(compiled) == [("planner", "coder"), ("coder", "reviewer")]
        out = await compiled.ainvoke({"messages": [HumanMessage("Write a function that reverses a string.")]})
        replies = {m.response_metadata["agent"]: m for m in out["messages"][1:]}
        assert list(replies) == list(ROLES)
        agents = engine.stats()["agents"]
        assert agents["planner"]["reused_tokens"] == 0          # nothing was prefilled before it
        for name in ("coder", "reviewer"):
            meta, usage = replies[name].response_metadata, replies[name].usage_metadata
            assert meta["reuse"] == "kvcmas"
            assert agents[name]["reused_tokens"] == meta["reused_tokens"] > 0, name
            assert 0 < meta["recomputed_tokens"] <= meta["reused_tokens"]
            assert usage["input_token_details"]["cache_read"] == (
                meta["cached_tokens"] + meta["reused_tokens"] - meta["recomputed_tokens"])
        # The reviewer also reuses the planner's reply, as the coder's request prefilled it.
        assert agents["reviewer"]["reused_tokens"] > agents["coder"]["reused_tokens"]
    finally:
        engine.close()


async def test_an_unregistered_graph_is_learned_from_its_first_turn():
    """Nobody registers the pipeline: the engine learns who hands off to whom (and each agent's system
    prompt) on the first turn, and corrects the coder's and reviewer's history ahead of time from the second."""
    engine = Engine(EngineConfig(reuse="kvcmas"))
    try:
        compiled = pipeline(ChatKVCMAS(engine=engine, max_tokens=8)).compile()
        await compiled.ainvoke({"messages": [HumanMessage("Write a function that adds two numbers.")]})
        stats = engine.stats()
        assert stats["edges"] == [] and stats["learned_edges"] == [("planner", "coder"), ("coder", "reviewer")]
        assert stats["reuse"]["kvcmas"]["prefetch"]["corrections"] == 0     # nothing known ahead yet
        await compiled.ainvoke({"messages": [HumanMessage("Write a function that subtracts two numbers.")]})
        by_agent = engine.stats()["reuse"]["kvcmas"]["prefetch"]["by_agent"]
        assert by_agent.get("coder", 0) > 0 and by_agent.get("reviewer", 0) > 0, by_agent
    finally:
        engine.close()


async def test_explicit_engine_kvcmas_pipeline_reuses_and_prefix_override_does_not(kvcmas_engine):
    task = {"messages": [HumanMessage("Write a function that counts vowels.")]}
    compiled = pipeline(ChatKVCMAS(engine=kvcmas_engine, max_tokens=12)).compile()
    before = kvcmas_engine.stats()["agents"]
    await compiled.ainvoke(task)
    reused = agent_deltas(kvcmas_engine, before, "reused_tokens")
    assert reused["coder"] > 0 and reused["reviewer"] > 0

    # reuse="prefix" on the same kvcmas engine applies per request: the same pipeline on a new task
    # (which the engine's own mode would reuse across agents, as above) reuses nothing.
    prefix = pipeline(ChatKVCMAS(engine=kvcmas_engine, max_tokens=12, reuse="prefix")).compile()
    before = kvcmas_engine.stats()["agents"]
    out = await prefix.ainvoke({"messages": [HumanMessage("Write a function that counts consonants.")]})
    for m in out["messages"][1:]:
        assert m.response_metadata["reuse"] == "prefix" and m.response_metadata["reused_tokens"] == 0
    assert agent_deltas(kvcmas_engine, before, "reused_tokens") == {a: 0 for a in ROLES}
    assert agent_deltas(kvcmas_engine, before, "requests") == {a: 1 for a in ROLES}


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def test_register_graph_declares_system_prompts_and_tools(kvcmas_engine):
    """Declared nodes find their own system prompt (with the coder's tool instructions) computed on
    their first call, and the coder and reviewer get their shared history corrected ahead of time."""
    systems = {n: f"{text} This is the declared team." for n, text in ROLES.items()}
    llm = ChatKVCMAS(engine=kvcmas_engine, max_tokens=12)
    compiled = pipeline(llm, roles=systems, models={"coder": llm.bind_tools([multiply])}).compile()
    with pytest.raises(ValueError, match="ghost"):
        register_graph(compiled, kvcmas_engine, systems=systems, tools={"ghost": [multiply]})
    with pytest.raises(ValueError):
        register_graph(compiled, kvcmas_engine, systems={"planner": 42})

    before = kvcmas_engine.stats()
    ahead = dict(before["reuse"]["kvcmas"]["prefetch"]["by_agent"])
    register_graph(compiled, kvcmas_engine, systems={"planner": systems["planner"], "coder": [SystemMessage(
        systems["coder"])], "reviewer": [{"role": "system", "content": systems["reviewer"]}]},
        tools={"coder": [multiply]})
    assert kvcmas_engine.stats()["counters"]["declared"] - before["counters"]["declared"] == 3
    out = await compiled.ainvoke({"messages": [HumanMessage("Write a function that squares a number.")]})
    replies = {m.response_metadata["agent"]: m for m in out["messages"][1:]}
    assert list(replies) == list(ROLES)
    assert all(m.response_metadata["cached_tokens"] > 0 for m in replies.values())
    by_agent = kvcmas_engine.stats()["reuse"]["kvcmas"]["prefetch"]["by_agent"]
    assert all(by_agent.get(a, 0) > ahead.get(a, 0) for a in ("coder", "reviewer")), by_agent
