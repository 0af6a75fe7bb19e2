"""Multi-agent conversation scenarios as data, and how an agent's prompt is built from the history.

Every agent sees ``[its system message] + [task] + [the shared history]``. Before each turn group a
moderator hand-off (a plain ``user`` message) asks for the next reply; it stays in the history. All
replies, the agent's own included, are ``user`` messages headed ``[name]``. That keeps every message's
tokens identical in every agent's prompt, so the engine's segment store can find it: an agent's own
reply rendered as an ``assistant`` message would be a segment nobody else has, whose KV the engine does
not keep from the decode, so the agent would prefill it (and, before the engine learned to bridge gaps,
everything after it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from . import scenario_texts as texts

History = list[tuple[str, str]]           # (speaker, text) in conversation order
MODERATOR = "moderator"


@dataclass(frozen=True)
class Scenario:
    """A conversation: who speaks in which order, over how many rounds.

    groups: one round's turn groups, in order. The agents of one group answer the same history
        concurrently (a fan-out); a group of one is an ordinary sequential turn.
    handoffs: per group, the moderator's request in round 1 and in later rounds.
    edges: the agent graph's edge order, for ``engine.set_edges``.
    """

    name: str
    systems: dict[str, str]
    task: str
    groups: tuple[tuple[str, ...], ...]
    handoffs: tuple[tuple[str, str], ...]
    rounds: int
    edges: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if len(self.handoffs) != len(self.groups):
            raise ValueError("one hand-off pair per turn group")

    def with_rounds(self, rounds: int) -> "Scenario":
        return replace(self, rounds=rounds)

    def schedule(self) -> list[tuple[int, tuple[str, ...], str]]:
        """Every turn group as (round, agents, hand-off), in order; rounds count from 1."""
        return [(r, g, h[0] if r == 1 else h[1]) for r in range(1, self.rounds + 1)
                for g, h in zip(self.groups, self.handoffs)]

    @property
    def num_turns(self) -> int:
        return self.rounds * sum(len(g) for g in self.groups)


def prompt_messages(scenario: Scenario, agent: str, history: History) -> list[dict[str, str]]:
    """The prompt ``agent`` sees: its own system message, the task, then the shared history."""
    messages = [{"role": "system", "content": scenario.systems[agent]},
                {"role": "user", "content": scenario.task}]
    messages += [{"role": "user", "content": text if name == MODERATOR else f"[{name}]\n{text}"}
                 for name, text in history]
    return messages


def declare_systems(engine: Any, scenario: Scenario) -> None:
    """Declare every agent's system message to the engine before the conversation, as the framework
    adapters do (``Engine.declare_agent``): first turns then find their own prefix computed, and
    the shared history corrected ahead of time along the edges."""
    for agent, system in scenario.systems.items():
        engine.declare_agent(agent, system)


def _chain(agents: tuple[str, ...], loop: bool) -> tuple[tuple[str, str], ...]:
    edges = tuple(zip(agents, agents[1:]))
    return edges + ((agents[-1], agents[0]),) if loop else edges


def _sequential(name: str, systems: dict[str, str], task: str, handoffs: dict[str, tuple[str, str]],
                rounds: int, loop: bool = True) -> Scenario:
    """Agents taking turns in the order of ``handoffs``, one after another."""
    order = tuple(handoffs)
    return Scenario(name, systems, task, tuple((a,) for a in order), tuple(handoffs.values()), rounds,
                    _chain(order, loop))


PIPELINE = _sequential("pipeline", texts.PIPELINE_SYSTEM, texts.PIPELINE_TASK, texts.PIPELINE_HANDOFFS, rounds=3)
DEBATE = _sequential("debate", texts.DEBATE_SYSTEM, texts.DEBATE_TASK, texts.DEBATE_HANDOFFS, rounds=3)

_EXPERTS = ("security", "performance", "database")
FANOUT = Scenario(
    "fanout", texts.FANOUT_SYSTEM, texts.FANOUT_TASK, groups=(_EXPERTS, ("summarizer",)),
    handoffs=(texts.FANOUT_HANDOFFS["experts"], texts.FANOUT_HANDOFFS["summarizer"]), rounds=2,
    edges=tuple((e, "summarizer") for e in _EXPERTS) + tuple(("summarizer", e) for e in _EXPERTS))

# The short coding conversation of the engine tests (planner -> coder -> reviewer, one round).
CSV = _sequential("csv", texts.CSV_SYSTEM, texts.CSV_TASK, {
    "planner": ("planner: break the task into numbered steps.",) * 2,
    "coder": ("coder: write the function.",) * 2,
    "reviewer": ("reviewer: point out bugs and risks in the code.",) * 2}, rounds=1, loop=False)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (PIPELINE, DEBATE, FANOUT, CSV)}
DEFAULT_SCENARIOS: tuple[str, ...] = ("pipeline", "debate", "fanout")


def get_scenario(name: str, quick: bool = False) -> Scenario:
    """A scenario by name; ``quick`` keeps one round."""
    try:
        scenario = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {sorted(SCENARIOS)}") from None
    return scenario.with_rounds(1) if quick else scenario
