"""Framework adapters. Each is imported lazily so that only the framework you use must be installed."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "KVCMASClient": "autogen",
    "register_team": "autogen",
    "ChatKVCMAS": "langchain",
    "register_graph": "langgraph",
    "graph_edges": "langgraph",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
