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
_holders: dict[str, int] = {}      # users that will release their engine (hold_engine / release_engine)
_kept: set[str] = set()            # engines handed out by get_engine, whose users never release them
_lock = threading.Lock()


def _key(model: str | None) -> str:
    return (model or DEFAULT_MODEL).lower() if not model or model.lower() == DEFAULT_MODEL else model


def get_engine(model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> Engine:
    """Return the shared engine for ``model``, creating it on first use.

    ``config``/``overrides`` apply only when the engine is created; later callers get the same one.
    """
    with _lock:
        _kept.add(_key(model))
        return _shared(model, config, overrides)


def hold_engine(model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> Engine:
    """``get_engine`` for a user that gives the engine back with ``release_engine`` when done.

    The engine closes when its last holder releases it, unless a ``get_engine`` caller shares it.
    """
    with _lock:
        _holders[_key(model)] = _holders.get(_key(model), 0) + 1
        return _shared(model, config, overrides)


def release_engine(engine: Engine) -> None:
    """Give back one ``hold_engine`` hold on ``engine``; closes it when no holder or other user is left."""
    with _lock:
        key = next((k for k, e in _engines.items() if e is engine), None)
        if key is None and engine._closed:
            return                      # already closed and dropped (close_all)
        if key is None or _holders.get(key, 0) == 0:
            raise ValueError("release_engine: this engine is not held through hold_engine")
        _holders[key] -= 1
        last = _holders[key] == 0 and key not in _kept
        if last:
            del _engines[key], _holders[key]
    if last:
        engine.close()


def _shared(model: str | None, config: EngineConfig | None, overrides: dict[str, Any]) -> Engine:
    key = _key(model)
    engine = _engines.get(key)
    if engine is None or engine._closed:
        base = config or EngineConfig()
        engine = Engine(replace(base, model=model, **overrides))
        _engines[key] = engine
    return engine


def register_engine(engine: Engine, model: str | None = None) -> None:
    """Make ``engine`` the shared engine for ``model`` (default: its configured model)."""
    key = _key(model if model is not None else engine.config.model)
    with _lock:
        _engines[key] = engine
        _kept.add(key)                  # the caller's engine: never closed by release_engine


def close_all() -> None:
    """Close every shared engine (tests, interpreter shutdown)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
        _holders.clear()
        _kept.clear()
    for engine in engines:
        engine.close()


# A shared engine's worker is a daemon thread, and it may be mid-step (say, an ahead-of-time
# correction) when the interpreter exits; torch torn down under it aborted the process ("terminate
# called without an active exception"). Closing first lets the worker finish its step and stop.
atexit.register(close_all)
