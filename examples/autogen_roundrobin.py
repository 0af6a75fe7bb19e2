"""planner -> coder -> reviewer as an AutoGen RoundRobinGroupChat on one embedded kvcmas engine.

    python examples/autogen_roundrobin.py [--max-tokens 64] [--messages 7] [--reuse kvcmas]

All three AssistantAgents share one KVCMASClient; the engine attributes each request to the
participant that made it, so the per-agent table at the end needs no per-agent setup. Each agent
sees the others' messages as user turns, rendered the same way for every agent, so with the default
reuse="kvcmas" an agent reuses the KV of a message that another agent already prefilled (the
"reused" column; "recomputed" counts the reused rows recomputed to correct them).
"""
from __future__ import annotations

import argparse
import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_agentchat.ui import Console

from kvcmas_agents.integrations.autogen import KVCMASClient, register_team

ROLES = {
    "planner": "You are the planner. Break the task into two or three short numbered steps.",
    "coder": "You are the coder. Write a short Python function that follows the plan.",
    "reviewer": "You are the reviewer. Point out one concrete problem in the code, or reply APPROVED.",
}
TASK = "Write a function that returns the n-th Fibonacci number."


def print_agent_stats(stats: dict) -> None:
    """One line per agent: requests, prompt/cached/reused/recomputed/generated tokens and mean TTFT."""
    print(f"\nengine: {stats['model']} on {stats['device']}, reuse={stats['reuse']}, edges={stats['edges']}")
    print(f"{'agent':<12}{'requests':>9}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}{'new':>6}"
          f"{'ttft_s':>8}")
    for name, a in stats["agents"].items():
        print(f"{name:<12}{int(a['requests']):>9}{int(a['prompt_tokens']):>8}{int(a['cached_tokens']):>8}"
              f"{int(a['reused_tokens']):>8}{int(a['recomputed_tokens']):>11}{int(a['completion_tokens']):>6}"
              f"{a.get('ttft_s_mean', 0.0):>8.2f}")


async def main(max_tokens: int, max_messages: int, reuse: str | None) -> None:
    client = KVCMASClient(max_tokens=max_tokens, reuse=reuse)
    agents = [AssistantAgent(name, model_client=client, system_message=prompt, model_client_stream=True)
              for name, prompt in ROLES.items()]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(max_messages))
    register_team(team)     # planner -> coder -> reviewer -> planner
    await Console(team.run_stream(task=TASK))
    print_agent_stats(client.engine.stats())
    await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--messages", type=int, default=7, help="stop after this many messages (task included)")
    parser.add_argument("--reuse", default=None, choices=["none", "prefix", "naive", "kvcmas"],
                        help="KV reuse mode (default: kvcmas)")
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.messages, args.reuse))
