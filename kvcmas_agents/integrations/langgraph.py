"""Register a LangGraph graph's agent edges with the engine, so reuse knows who feeds whom."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from langchain_core.utils.function_calling import convert_to_openai_tool

from ..engine import Engine
from ._lc_messages import to_engine_messages
from ..registry import ADAPTER_REUSE, get_engine

_VIRTUAL = ("__start__", "__end__")


def graph_edges(graph: Any) -> list[tuple[str, str]]:
    """The (source, target) node edges of a compiled LangGraph graph or its ``StateGraph`` builder.

    Includes plain, waiting (``add_edge([a, b], c)``) and conditional edges. ``Send`` fan-outs
    are visible only when the router declares its targets (a ``path_map`` or a ``Literal``
    return type). The start/end markers are dropped; edges come out in node-definition order.
    """
    builder = getattr(graph, "builder", graph)
    # LangGraph's drawable graph (``get_graph()``) leaves out nodes it cannot reach from the start, such as
    # those only an undeclared ``Send`` reaches, with their edges; the builder's public edge and branch
    # tables still have them, so both are read.
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


def register_graph(graph: Any, model_or_engine: Engine | str | Any | None = None,
                   systems: Mapping[str, str | Sequence[Any]] | None = None,
                   tools: Mapping[str, Sequence[Any]] | None = None) -> list[tuple[str, str]]:
    """Register ``graph``'s node edges with the engine and return them.

    ``model_or_engine``: an ``Engine``, a model name for the shared registry engine (None: the
    default model; created with reuse="kvcmas" if new), or a ``ChatKVCMAS`` whose engine to use.
    Node names are the agent names the engine sees from ``ChatKVCMAS`` calls made inside those nodes.

    ``systems`` maps node names to the system prompt each node's calls start with (a string, or
    LangChain / OpenAI-style system messages), and ``tools`` to the tools its model is bound to.
    Each is declared to the engine (``Engine.declare_agent``): the prompt is prefilled now, and the
    node's graph predecessors correct the shared history for it ahead of time from its very first
    turn. A declaration that differs from what the node really sends is never used.
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
    unknown = sorted(set(tools or ()) - set(systems or ()))
    if unknown:
        raise ValueError(f"tools given for nodes without a system prompt in systems: {unknown}")
    engine.set_edges(edges)
    for node, system in (systems or {}).items():
        specs = [convert_to_openai_tool(t) for t in (tools or {}).get(node, ())] or None
        engine.declare_agent(node, _system_messages(node, system), specs)
    return edges


def _system_messages(node: str, system: str | Sequence[Any]) -> str | list[dict[str, Any]]:
    if isinstance(system, str):
        return system
    if not isinstance(system, Sequence) or not system:
        raise ValueError(f"systems[{node!r}] must be a string or a non-empty list of system messages")
    return [m if isinstance(m, dict) else to_engine_messages([m])[0] for m in system]
