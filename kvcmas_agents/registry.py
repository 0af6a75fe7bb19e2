"""Process-wide engines: every client naming the same model shares one engine."""
from __future__ import annotations

import atexit
import threading
from dataclasses import replace
from typing import Any

from .engine import Engine, EngineConfig
from .model.loader import DEFAULT_MODEL

ADAPTER_REUSE = "kvcmas"
"""Reuse mode the framework adapters create a shared engine with when the user names none."""

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _key(model: str | None) -> str:
    return (model or DEFAULT_MODEL).lower() if not model or model.lower() == DEFAULT_MODEL else model


def get_engine(model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> Engine:
    """Return the shared engine for ``model``, creating it on first use.

    ``config``/``overrides`` apply only when the engine is created; later callers get the same one.
    """
    key = _key(model)
    with _lock:
        engine = _engines.get(key)
        if engine is None or engine._closed:
            base = config or EngineConfig()
            engine = Engine(replace(base, model=model, **overrides))
            _engines[key] = engine
        return engine


def register_engine(engine: Engine, model: str | None = None) -> None:
    """Make ``engine`` the shared engine for ``model`` (default: its configured model)."""
    with _lock:
        _engines[_key(model if model is not None else engine.config.model)] = engine


def close_all() -> None:
    """Close every shared engine (tests, interpreter shutdown)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()


# A shared engine's worker is a daemon thread, and it may be mid-step (say, an ahead-of-time
# correction) when the interpreter exits; torch torn down under it aborted the process ("terminate
# called without an active exception"). Closing first lets the worker finish its step and stop.
atexit.register(close_all)
