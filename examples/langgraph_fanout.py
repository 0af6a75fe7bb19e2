"""Fan-out with LangGraph ``Send``: parallel experts, then a summarizer, on one embedded kvcmas engine.

    python examples/langgraph_fanout.py [--max-tokens 48] [--reuse kvcmas]

The experts run as parallel branches of one superstep. Their requests reach the shared engine at
the same time and decode together in the same forward steps; ``max_batch_seqs`` in the engine
stats shows how many sequences one step carried. The summarizer's prompt repeats the question
message every expert saw; with the default reuse="kvcmas" it reuses the KV the experts computed for
that message instead of prefilling it again (the "reused" column; the experts themselves prefill it
side by side in one step, so they have nothing to reuse).
"""
from __future__ import annotations

import argparse
import asyncio
import operator
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from kvcmas_agents.integrations.langchain import ChatKVCMAS
from kvcmas_agents.integrations.langgraph import register_graph

EXPERTS = {
    "security": "You are a security expert. Give one short security recommendation.",
    "performance": "You are a performance expert. Give one short performance recommendation.",
    "testing": "You are a testing expert. Give one short testing recommendation.",
    "usability": "You are a usability expert. Give one short usability recommendation.",
}
SUMMARIZER = "You summarize expert advice in two sentences."
QUESTION = "We are building a web API that lets users upload and share photos. What should we watch out for?"


class Panel(TypedDict):
    question: str
    answers: Annotated[list[str], operator.add]
    summary: str


def build_graph(llm: ChatKVCMAS) -> StateGraph:
    """START fans out to one node per expert (via Send); all of them feed the summarizer."""
    def fan_out(state: Panel) -> list[Send]:
        return [Send(f"expert_{area}", state) for area in EXPERTS]

    def expert(area: str):
        async def node(state: Panel) -> dict:
            reply = await llm.ainvoke([SystemMessage(EXPERTS[area]), HumanMessage(state["question"])])
            return {"answers": [f"[{area}] {reply.content.strip()}"]}
        return node

    async def summarizer(state: Panel) -> dict:
        notes = "\n".join(state["answers"])
        reply = await llm.ainvoke([SystemMessage(SUMMARIZER),
                                   HumanMessage(state["question"]), HumanMessage(f"Advice:\n{notes}")])
        return {"summary": reply.content.strip()}

    graph = StateGraph(Panel)
    for area in EXPERTS:
        graph.add_node(f"expert_{area}", expert(area))
        graph.add_edge(f"expert_{area}", "summarizer")
    graph.add_node("summarizer", summarizer)
    # The path map makes the Send targets visible to register_graph.
    graph.add_conditional_edges(START, fan_out, [f"expert_{area}" for area in EXPERTS])
    graph.add_edge("summarizer", END)
    return graph


async def main(max_tokens: int, reuse: str | None) -> None:
    llm = ChatKVCMAS(max_tokens=max_tokens, reuse=reuse)
    compiled = build_graph(llm).compile()
    # Edges, and the system prompt each node starts with (prefilled now, before the fan-out).
    register_graph(compiled, llm, systems={**{f"expert_{a}": text for a, text in EXPERTS.items()},
                                           "summarizer": SUMMARIZER})
    out = await compiled.ainvoke({"question": QUESTION, "answers": []})
    print("\n\n".join(out["answers"]))
    print(f"\n--- summary\n{out['summary']}")

    stats = llm.get_engine().stats()
    batched = "the experts ran batched" if stats["counters"]["max_batch_seqs"] > 1 else "no batching happened"
    e, c = stats["engine"], stats["counters"]
    print(f"\nengine: {e['model']} on {e['device']}, reuse={e['reuse']}; {c['steps']} forward "
          f"steps, up to {c['max_batch_seqs']} sequences in one step ({batched})")
    print(f"{'agent':<20}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}{'new':>6}{'ttft_s':>8}")
    for name, a in stats["agents"].items():
        print(f"{name:<20}{int(a['prompt_tokens']):>8}{int(a['cached_tokens']):>8}{int(a['reused_tokens']):>8}"
              f"{int(a['recomputed_tokens']):>11}{int(a['completion_tokens']):>6}{a.get('ttft_s_mean', 0.0):>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reuse", default=None, choices=["none", "prefix", "naive", "kvcmas"],
                        help="KV reuse mode (default: kvcmas)")
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.reuse))
