"""Framework clients speaking plain OpenAI HTTP to the gateway: a 3-agent LangGraph workflow on
ChatOpenAI and a 3-agent AutoGen round robin on OpenAIChatCompletionClient. Later agents reuse the KV
of history that earlier agents prefilled (the gateway's default reuse mode, kvcmas)."""
from __future__ import annotations

import pytest

from serve_gateway import API_KEY, MODEL  # type: ignore[import-not-found]
from kvcmas_agents.serve.naming import derived_agent

ROLES = ("planner", "coder", "reviewer")
KEYS = ("requests", "prompt_tokens", "reused_tokens", "recomputed_tokens")


def agent_deltas(before: dict, after: dict, names) -> dict[str, dict[str, float]]:
    return {n: {k: after[n][k] - before.get(n, {}).get(k, 0) for k in KEYS} for n in names}


def test_langgraph_three_agents_on_chat_openai(gateway):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    session = "lg-workflow-1"
    with gateway.client() as c:      # the workflow's hand-off order, declared over HTTP
        r = c.post("/v1/kvcmas/edges", json={"edges": [["planner", "coder"], ["coder", "reviewer"]]},
                   headers={"X-KVCMAS-Session": session})
        assert r.status_code == 200 and r.json()["session"] == session
    assert gateway.stats()["edges"] == [["planner", "coder"], ["coder", "reviewer"]]

    def node(role: str):
        llm = ChatOpenAI(model=MODEL, base_url=gateway.base_url, api_key=API_KEY, temperature=0,
                         max_tokens=10, max_retries=0,
                         default_headers={"X-KVCMAS-Agent": role, "X-KVCMAS-Session": session})

        def run(state: MessagesState) -> dict:
            reply = llm.invoke([SystemMessage(f"You are the {role} of a small software team. Be brief."),
                                *state["messages"]])
            assert reply.usage_metadata["input_tokens"] > 0
            return {"messages": [AIMessage(reply.content, name=role)]}
        return run

    g = StateGraph(MessagesState)
    for role in ROLES:
        g.add_node(role, node(role))
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", "reviewer")
    g.add_edge("reviewer", END)
    before = gateway.stats()["agents"]
    out = g.compile().invoke({"messages": [HumanMessage("Write a function that reverses a string.")]})
    assert [m.name for m in out["messages"][1:]] == list(ROLES)
    delta = agent_deltas(before, gateway.stats()["agents"], ROLES)
    assert all(d["requests"] == 1 for d in delta.values())
    # Each later agent reads the same growing history: longer prompts, and KV reused from earlier agents.
    assert delta["planner"]["prompt_tokens"] < delta["coder"]["prompt_tokens"] < delta["reviewer"]["prompt_tokens"]
    assert delta["coder"]["reused_tokens"] > 0 and delta["reviewer"]["reused_tokens"] > 0, delta
    assert all(d["recomputed_tokens"] <= d["reused_tokens"] for d in delta.values())


async def test_autogen_round_robin_on_openai_client(gateway):
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model=MODEL, base_url=gateway.base_url, api_key=API_KEY, temperature=0,
        max_tokens=10, max_retries=0,
        model_info={"vision": False, "function_calling": True, "json_output": True,
                    "structured_output": True, "family": "unknown"})
    systems = {n: f"You are the {n} in a round-robin team. Be brief." for n in ROLES}
    agents = [AssistantAgent(n, model_client=client, system_message=systems[n]) for n in ROLES]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(4))
    # No agent header: the gateway names each agent after its system prompt.
    names = {n: derived_agent([{"role": "system", "content": systems[n]}]) for n in ROLES}
    before = gateway.stats()["agents"]
    result = await team.run(task="Plan a tiny hello-world script.")
    await client.close()
    assert [m.source for m in result.messages] == ["user", *ROLES]
    delta = agent_deltas(before, gateway.stats()["agents"], names.values())
    assert all(d["requests"] == 1 for d in delta.values()), delta
    assert delta[names["coder"]]["reused_tokens"] > 0 and delta[names["reviewer"]]["reused_tokens"] > 0, delta
