"""The edge order learned from traffic (engine/handoffs.py), without a model."""
from __future__ import annotations

from kvcmas_agents.engine.handoffs import HandOffs


def run(h: HandOffs, agent: str, completed: bool = True) -> None:
    h.arrived(agent)
    h.finished(agent, completed)


def test_sequential_hand_offs_are_learned_once_in_order():
    h = HandOffs()
    for _ in range(2):
        for agent in ("planner", "coder", "coder", "reviewer"):     # a repeat is not an edge
            run(h, agent)
    assert h.edges == [("planner", "coder"), ("coder", "reviewer"), ("reviewer", "planner")]


def test_overlapping_and_failed_requests_teach_nothing():
    h = HandOffs()
    run(h, "router")
    h.arrived("expert_a")          # the first of a fan-out follows the router
    h.arrived("expert_b")          # arrives while expert_a runs
    h.finished("expert_a", True)
    h.finished("expert_b", True)
    run(h, "judge", completed=False)
    run(h, "summary")              # follows the last completed request, not the failed one
    assert h.edges == [("router", "expert_a"), ("expert_b", "judge"), ("expert_b", "summary")]
