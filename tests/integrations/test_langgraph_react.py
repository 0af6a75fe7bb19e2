"""LangGraph's prebuilt ReAct agents on the real default model through ChatKVCMAS."""
from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from kvcmas_agents.integrations.langchain import ChatKVCMAS
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import create_react_agent

# Moved to langchain.agents in LangGraph 1.0 (not installed here); still the agent users know.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")

# The 135M model copies a tool call it is shown; 16 tokens cut the block off before its arguments.
COPY_WEATHER = ('Copy this text exactly, with no other words:\n'
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"Sunny in {city}"


def test_truncated_tool_call_is_invalid_streamed_or_not(engine_prefix):
    agent = create_react_agent(ChatKVCMAS(engine=engine_prefix, max_tokens=16), [get_weather])
    inputs, config = {"messages": [HumanMessage(COPY_WEATHER)]}, {"recursion_limit": 4}

    invoked = agent.invoke(inputs, config)["messages"][1:]
    parts = list(agent.stream(inputs, config, stream_mode=["messages", "values"]))   # messages: the model streams
    chunks = [part[0] for mode, part in parts if mode == "messages"]
    streamed = [part for mode, part in parts if mode == "values"][-1]["messages"][1:]

    for replies in (invoked, streamed):
        assert len(replies) == 1 and isinstance(replies[0], AIMessage), replies
        assert replies[0].tool_calls == [] and len(replies[0].invalid_tool_calls) == 1
    assert not any(isinstance(m, ToolMessage) for m in chunks)
    bad = [r[0].invalid_tool_calls[0] for r in (invoked, streamed)]
    assert bad[0]["name"] == bad[1]["name"] == "get_weather"
    assert bad[0]["args"] == bad[1]["args"] and bad[0]["args"].startswith('<tool_call>{"name": "get_weather"')
    assert "invalid JSON" in bad[0]["error"]


def test_react_agent_calls_its_tool_then_answers(engine_prefix):
    """tool_choice is left to the model: ChatKVCMAS's decision step makes it call, then answer the result."""
    agent = create_react_agent(ChatKVCMAS(engine=engine_prefix, max_tokens=32), [get_weather])
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]}, {"recursion_limit": 6})
    call, result, answer = out["messages"][1:]
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert isinstance(result, ToolMessage) and result.content == "Sunny in Paris"
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.content


def test_react_agents_used_as_nodes_are_accounted_by_their_names(engine_prefix):
    llm = ChatKVCMAS(engine=engine_prefix, max_tokens=4)
    team = StateGraph(MessagesState)
    for name in ("researcher", "writer"):
        team.add_node(create_react_agent(llm, [get_weather], name=name))
    team.add_node("critic", lambda state: {"messages": [llm.invoke(state["messages"])]})
    team.add_edge(START, "researcher")
    team.add_edge("researcher", "writer")
    team.add_edge("writer", "critic")
    out = team.compile().invoke({"messages": [HumanMessage("Write one line about Paris.")]})
    assert [m.response_metadata["agent"] for m in out["messages"][1:]] == ["researcher", "writer", "critic"]


def test_the_models_name_and_agent_fields_beat_the_node(engine_prefix):
    def node(model: ChatKVCMAS):
        return lambda state: {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("first", node(ChatKVCMAS(engine=engine_prefix, max_tokens=2, name="named")))
    graph.add_node("second", node(ChatKVCMAS(engine=engine_prefix, max_tokens=2, name="named", agent="explicit")))
    graph.add_node("third", node(ChatKVCMAS(engine=engine_prefix, max_tokens=2).bind(agent="bound")))
    graph.add_edge(START, "first")
    graph.add_edge("first", "second")
    graph.add_edge("second", "third")
    out = graph.compile().invoke({"messages": [HumanMessage("Hi")]})
    assert [m.response_metadata["agent"] for m in out["messages"][1:]] == ["named", "explicit", "bound"]
