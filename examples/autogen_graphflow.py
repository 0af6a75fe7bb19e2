"""writer -> editor -> summarizer as an AutoGen GraphFlow on one embedded kvcmas engine.

    python examples/autogen_graphflow.py [--max-tokens 64] [--reuse kvcmas]

The DiGraph's edges are registered with the engine (``register_team``) so that each agent's
predecessor in the pipeline is known to it. With the default reuse="kvcmas", the summarizer reuses
the KV the editor computed for the task and the writer's paragraph, and the editor reuses the
writer's KV of the task (the "reused" column; "recomputed" counts the reused rows recomputed to
correct them).
"""
from __future__ import annotations

import argparse
import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import DiGraphBuilder, GraphFlow

from kvcmas_agents.integrations.autogen import KVCMASClient, register_team

ROLES = {
    "writer": "You are the writer. Write a short paragraph on the topic you are given.",
    "editor": "You are the editor. Rewrite the previous paragraph so it is clearer and shorter.",
    "summarizer": "You are the summarizer. Summarize the edited paragraph in one sentence.",
}
TOPIC = "Why sharing a KV cache between cooperating agents saves memory."


async def main(max_tokens: int, reuse: str | None) -> None:
    client = KVCMASClient(max_tokens=max_tokens, reuse=reuse)
    writer, editor, summarizer = (AssistantAgent(name, model_client=client, system_message=prompt)
                                  for name, prompt in ROLES.items())
    builder = DiGraphBuilder()
    builder.add_node(writer).add_node(editor).add_node(summarizer)
    builder.add_edge(writer, editor).add_edge(editor, summarizer)
    flow = GraphFlow([writer, editor, summarizer], graph=builder.build())
    print("edges:", register_team(flow))

    async for event in flow.run_stream(task=TOPIC):
        source, content = getattr(event, "source", None), getattr(event, "content", None)
        if source is not None and isinstance(content, str):
            print(f"\n---------- {source} ----------\n{content}")
    stats = client.engine.stats()
    e = stats["engine"]
    print(f"\nengine: {e['model']} on {e['device']}, reuse={e['reuse']}, edges={stats['edges']}")
    print(f"{'agent':<12}{'requests':>9}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}{'new':>6}")
    for name, a in stats["agents"].items():
        print(f"{name:<12}{int(a['requests']):>9}{int(a['prompt_tokens']):>8}{int(a['cached_tokens']):>8}"
              f"{int(a['reused_tokens']):>8}{int(a['recomputed_tokens']):>11}{int(a['completion_tokens']):>6}")
    await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reuse", default=None, choices=["none", "prefix", "naive", "kvcmas"],
                        help="KV reuse mode (default: kvcmas)")
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.reuse))
