"""planner -> coder -> reviewer -> tester as a LangGraph graph on one embedded kvcmas engine.

This is what ``kvcmas demo`` (and ``examples/langgraph_pipeline.py``) runs. Every node calls the same
ChatKVCMAS with its own system prompt in front of the shared MessagesState history (other agents'
replies shown as user turns headed with their name). The engine names each request after the
LangGraph node that made it, so the per-agent table at the end needs no per-agent setup. With the
default reuse="kvcmas", a message that an earlier agent already prefilled is served from that
agent's KV (the "reused" column; "recomputed" counts the reused rows recomputed to correct them);
from round 2 on each agent's prompt also starts with its round-1 prompt, which its prefix cache
serves ("cached"). Compare with ``--reuse prefix``.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from ..engine import Engine, EngineConfig
from ..reuse import names as reuse_modes
from .agent_table import print_agent_stats
from .engine_pipeline import device_arg

ROLES = {
    "planner": "You are the planner. Break the task into two or three short numbered steps. No code.",
    "coder": "You are the coder. Write a short Python function that follows the plan.",
    "reviewer": "You are the reviewer. Point out one concrete problem in the latest code, or reply APPROVED.",
    "tester": "You are the tester. List two edge cases the function must handle.",
}
TASK = "Write a function that returns the n-th Fibonacci number."


def _require_langgraph() -> None:
    try:
        import langgraph  # noqa: F401
    except ImportError:
        raise ImportError("the LangGraph demo needs langgraph: pip install 'kvcmas-agents[langchain]'") from None


def view_for(name: str, messages: list) -> list:
    """The shared history as agent `name` sees it: its own replies as assistant turns, others' as user turns."""
    from langchain_core.messages import AIMessage, HumanMessage
    return [HumanMessage(f"[{m.name}] {m.content}") if isinstance(m, AIMessage) and m.name != name else m
            for m in messages]


def build_graph(llm, rounds: int):
    """The four agents in order; the tester loops back to the planner until `rounds` are done."""
    from langchain_core.messages import SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    def agent(name: str):
        async def node(state) -> dict:   # MessagesState (annotation omitted: imported lazily)
            reply = await llm.ainvoke([SystemMessage(ROLES[name]), *view_for(name, state["messages"])])
            reply.name = name
            return {"messages": [reply]}
        return node

    def next_round(state) -> str:
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


async def run_graph(llm, rounds: int, task: str = TASK) -> None:
    """Compile the graph, register its edges and system prompts with the engine, stream it, print each
    node's reply."""
    from langchain_core.messages import HumanMessage

    from ..integrations.langgraph import register_graph

    compiled = build_graph(llm, rounds).compile()
    # The edges, and each node's system prompt: declared, it is prefilled now, and from the first round
    # on each agent's predecessor corrects the shared history for it while it decodes.
    register_graph(compiled, llm, systems=ROLES)
    async for update in compiled.astream({"messages": [HumanMessage(task)]}, stream_mode="updates"):
        for node, change in update.items():
            reply = change["messages"][-1]
            usage, meta = reply.usage_metadata, reply.response_metadata
            print(f"--- {node} (ttft {meta['ttft_s']:.2f}s, cache read "
                  f"{usage['input_token_details']['cache_read']}/{usage['input_tokens']} prompt tokens: "
                  f"{meta['cached_tokens']} cached, {meta['reused_tokens']} reused from other agents)")
            print(reply.content.strip(), "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvcmas demo`` and ``examples/langgraph_pipeline.py``."""
    parser.add_argument("--rounds", type=int, default=2, help="pipeline rounds (default 2)")
    parser.add_argument("--max-tokens", type=int, default=48, help="max new tokens per turn (default 48)")
    parser.add_argument("--reuse", choices=reuse_modes(), default="kvcmas", help="KV reuse mode (default kvcmas)")
    parser.add_argument("--model", default=None, help="local checkpoint dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", type=device_arg, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--task", default=TASK, help="the coding task to work on")


def run(args: argparse.Namespace) -> int:
    """Build one engine, run the graph on it, print replies and the per-agent table."""
    if args.rounds < 1 or args.max_tokens < 1:
        raise ValueError("--rounds and --max-tokens must be positive")
    _require_langgraph()
    from ..integrations.langchain import ChatKVCMAS

    engine = Engine(EngineConfig(model=args.model, device=args.device, reuse=args.reuse))
    try:
        llm = ChatKVCMAS(model=args.model, max_tokens=args.max_tokens, engine=engine)
        print(f"task: {args.task}\n")
        start = time.perf_counter()
        asyncio.run(run_graph(llm, args.rounds, args.task))
        print_agent_stats(engine.stats())
        print(f"wall time: {time.perf_counter() - start:.1f} s")
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``examples/langgraph_pipeline.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except (ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
