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

from kvcmas_agents.demos.agent_table import print_agent_stats
from kvcmas_agents.integrations.autogen import KVCMASClient, register_team

ROLES = {
    "planner": "You are the planner. Break the task into two or three short numbered steps.",
    "coder": "You are the coder. Write a short Python function that follows the plan.",
    "reviewer": "You are the reviewer. Point out one concrete problem in the code, or reply APPROVED.",
}
TASK = "Write a function that returns the n-th Fibonacci number."


async def main(max_tokens: int, max_messages: int, reuse: str | None) -> None:
    client = KVCMASClient(max_tokens=max_tokens, reuse=reuse)
    agents = [AssistantAgent(name, model_client=client, system_message=prompt, model_client_stream=True)
              for name, prompt in ROLES.items()]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(max_messages))
    register_team(team)     # planner -> coder -> reviewer -> planner; declares each system message too
    await Console(team.run_stream(task=TASK))
    print_agent_stats(client.engine.stats(), width=12)
    await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--messages", type=int, default=7, help="stop after this many messages (task included)")
    parser.add_argument("--reuse", default=None, choices=["none", "prefix", "naive", "kvcmas"],
                        help="KV reuse mode (default: kvcmas)")
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.messages, args.reuse))
