"""planner -> coder -> reviewer -> tester as a LangGraph graph on one embedded kvcmas engine.

    python examples/langgraph_pipeline.py [--rounds 2] [--max-tokens 48] [--reuse prefix]

Every node calls the same ChatKVCMAS with its own system prompt in front of the shared
MessagesState history (other agents' replies shown as user turns headed with their name). The
engine names each request after the LangGraph node that made it, so the per-agent table at the end
needs no per-agent setup. With the default reuse="kvcmas", a message that an earlier agent already
prefilled is served from that agent's KV (the "reused" column; "recomputed" counts the reused rows
recomputed to correct them); from round 2 on each agent's prompt also starts with its round-1
prompt, which its prefix cache serves ("cached"). Compare with ``--reuse prefix``.
"""
from __future__ import annotations

import argparse
import asyncio

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from kvcmas_agents.integrations.langchain import ChatKVCMAS
from kvcmas_agents.integrations.langgraph import register_graph

ROLES = {
    "planner": "You are the planner. Break the task into two or three short numbered steps. No code.",
    "coder": "You are the coder. Write a short Python function that follows the plan.",
    "reviewer": "You are the reviewer. Point out one concrete problem in the latest code, or reply APPROVED.",
    "tester": "You are the tester. List two edge cases the function must handle.",
}
TASK = "Write a function that returns the n-th Fibonacci number."


def view_for(name: str, messages: list[BaseMessage]) -> list[BaseMessage]:
    """The shared history as agent `name` sees it: its own replies as assistant turns, others' as user turns."""
    return [HumanMessage(f"[{m.name}] {m.content}") if isinstance(m, AIMessage) and m.name != name else m
            for m in messages]


def build_graph(llm: ChatKVCMAS, rounds: int) -> StateGraph:
    """The four agents in order; the tester loops back to the planner until `rounds` are done."""
    def agent(name: str):
        async def node(state: MessagesState) -> dict:
            reply = await llm.ainvoke([SystemMessage(ROLES[name]), *view_for(name, state["messages"])])
            reply.name = name
            return {"messages": [reply]}
        return node

    def next_round(state: MessagesState) -> str:
        done = sum(1 for m in state["messages"] if m.name == "tester")
        return "planner" if done < rounds else END

    graph = StateGraph(MessagesState)
    for name in ROLES:
        graph.add_node(name, agent(name))
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "coder")
    graph.add_edge("coder", "reviewer")
    graph.add_edge("reviewer", "tester")
    graph.add_conditional_edges("tester", next_round, ["planner", END])
    return graph


def print_agent_stats(stats: dict) -> None:
    """One line per agent: requests, prompt/cached/reused/recomputed/generated tokens and mean TTFT."""
    print(f"\nengine: {stats['model']} on {stats['device']}, reuse={stats['reuse']}, edges={stats['edges']}")
    print(f"{'agent':<10}{'requests':>9}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}{'new':>6}"
          f"{'ttft_s':>8}")
    for name, a in stats["agents"].items():
        print(f"{name:<10}{int(a['requests']):>9}{int(a['prompt_tokens']):>8}{int(a['cached_tokens']):>8}"
              f"{int(a['reused_tokens']):>8}{int(a['recomputed_tokens']):>11}{int(a['completion_tokens']):>6}"
              f"{a.get('ttft_s_mean', 0.0):>8.2f}")


async def main(rounds: int, max_tokens: int, reuse: str | None) -> None:
    llm = ChatKVCMAS(max_tokens=max_tokens, reuse=reuse)
    compiled = build_graph(llm, rounds).compile()
    register_graph(compiled, llm)
    async for update in compiled.astream({"messages": [HumanMessage(TASK)]}, stream_mode="updates"):
        for node, change in update.items():
            reply = change["messages"][-1]
            usage = reply.usage_metadata
            meta = reply.response_metadata
            print(f"--- {node} (ttft {meta['ttft_s']:.2f}s, cache read "
                  f"{usage['input_token_details']['cache_read']}/{usage['input_tokens']} prompt tokens: "
                  f"{meta['cached_tokens']} cached, {meta['reused_tokens']} reused from other agents)")
            print(reply.content.strip(), "\n")
    print_agent_stats(llm.get_engine().stats())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reuse", default=None, choices=["none", "prefix", "naive", "kvcmas"],
                        help="KV reuse mode (default: kvcmas)")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.max_tokens, args.reuse))
