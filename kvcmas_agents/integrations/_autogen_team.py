"""Agent identity and edge order for AutoGen teams, read from AutoGen's own objects."""
from __future__ import annotations

import sys
from typing import Any

from autogen_core import MessageHandlerContext

_MAX_FRAMES = 64     # the agent's method is a few frames above the client call; stop well before the loop's


def calling_agent_name() -> str | None:
    """The name of the AgentChat agent whose method is calling the model client, or None.

    AgentChat hands the client no identity, and an agent run on its own (``agent.run``) has no
    message-handler context, so the caller's frames are searched for the agent method making the call.
    """
    try:
        from autogen_agentchat.base import ChatAgent
    except ImportError:          # autogen-core alone: there are no AgentChat agents
        return None
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, ChatAgent):
            return owner.name
        frame = frame.f_back
    return None


def current_agent_name() -> str | None:
    """The name of the AutoGen agent whose message handler is running, or None outside one.

    AgentChat teams register each participant under the agent type ``"<name>_<team_id>"`` with key
    ``<team_id>``, so stripping the key suffix recovers the participant's name. Plain Core agents
    keep their type as the name.
    """
    try:
        agent_id = MessageHandlerContext.agent_id()
    except RuntimeError:
        return None
    suffix = f"_{agent_id.key}"
    if agent_id.type.endswith(suffix) and len(agent_id.type) > len(suffix):
        return agent_id.type[: -len(suffix)]
    return agent_id.type


def team_edges(team: Any) -> list[tuple[str, str]]:
    """(predecessor, successor) pairs for a team's speaking order.

    GraphFlow: its DiGraph edges. RoundRobinGroupChat: the participants' cycle (a→b→c→a).
    SelectorGroupChat and other group chats: the same cycle over the participant order, as an
    approximation, since the speaker is picked at run time.
    """
    # Read from the team's own attributes: AgentChat has no public accessor for them, and its public
    # ``dump_component()``, which carries the same participants and graph, serializes every participant
    # with it (model clients, tools' source code) and fails on a custom agent without a config or a tool
    # whose source cannot be read, so it would need this same fallback anyway.
    graph = getattr(team, "_graph", None)
    if graph is not None and hasattr(graph, "nodes"):
        return [(node.name, edge.target) for node in graph.nodes.values() for edge in node.edges]
    names = getattr(team, "_participant_names", None)
    if names is None:
        participants = getattr(team, "_participants", None)
        if participants is None:
            raise TypeError(f"register_team needs an AgentChat group chat team, got {type(team).__name__}")
        names = [p.name for p in participants]
    if len(names) < 2:
        return []
    return [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]
