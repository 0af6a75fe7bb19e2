"""Register a LangGraph graph's agent edges with the engine, so reuse knows who feeds whom."""
from __future__ import annotations

from typing import Any

from ..engine import Engine
from ..registry import ADAPTER_REUSE, get_engine

_VIRTUAL = ("__start__", "__end__")


def graph_edges(graph: Any) -> list[tuple[str, str]]:
    """The (source, target) node edges of a compiled LangGraph graph or its ``StateGraph`` builder.

    Includes plain, waiting (``add_edge([a, b], c)``) and conditional edges. ``Send`` fan-outs
    are visible only when the router declares its targets (a ``path_map`` or a ``Literal``
    return type). The start/end markers are dropped; edges come out in node-definition order.
    """
    builder = getattr(graph, "builder", graph)
    found: set[tuple[str, str]] = set()
    if hasattr(graph, "get_graph"):
        found.update((e.source, e.target) for e in graph.get_graph().edges)
    found.update(getattr(builder, "edges", ()))
    for sources, target in getattr(builder, "waiting_edges", ()):
        found.update((s, target) for s in sources)
    for source, branches in getattr(builder, "branches", {}).items():
        for branch in branches.values():
            found.update((source, t) for t in (getattr(branch, "ends", None) or {}).values())
    order = {name: i for i, name in enumerate(getattr(builder, "nodes", {}))}
    edges = [e for e in found if e[0] not in _VIRTUAL and e[1] not in _VIRTUAL]
    return sorted(edges, key=lambda e: (order.get(e[0], len(order)), order.get(e[1], len(order)), e))


def register_graph(graph: Any, model_or_engine: Engine | str | Any | None = None) -> list[tuple[str, str]]:
    """Register ``graph``'s node edges with the engine and return them.

    ``model_or_engine``: an ``Engine``, a model name for the shared registry engine (None: the
    default model; created with reuse="kvcmas" if new), or a ``ChatKVCMAS`` whose engine to use.
    Node names are the agent names the engine sees from ``ChatKVCMAS`` calls made inside those nodes.
    """
    if isinstance(model_or_engine, Engine):
        engine = model_or_engine
    elif model_or_engine is None or isinstance(model_or_engine, str):
        engine = get_engine(model_or_engine, reuse=ADAPTER_REUSE)
    elif callable(getattr(model_or_engine, "get_engine", None)):
        engine = model_or_engine.get_engine()
    else:
        raise TypeError(f"expected an Engine, a model name or a ChatKVCMAS, got {type(model_or_engine).__name__}")
    edges = graph_edges(graph)
    engine.set_edges(edges)
    return edges
