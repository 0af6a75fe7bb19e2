"""Reuse methods by name. A method registers itself with ``@register``; ``kvcmas_agents.reuse``
imports every built-in method, so the registry is complete once the package is imported."""
from __future__ import annotations

from typing import Any, TypeVar

# Methods are ReuseMethod subclasses (base.py); the registry does not import them, so that base can
# depend on what the registry serves (options) without a cycle.
M = TypeVar("M", bound=type)
_METHODS: dict[str, Any] = {}


def register(cls: M) -> M:
    """Class decorator: make a ReuseMethod subclass available as ``reuse=cls.name``."""
    if cls.name in _METHODS:
        raise ValueError(f"reuse method {cls.name!r} is registered twice")
    _METHODS[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """Every registered method's name, in registration order."""
    return tuple(_METHODS)


def method_class(name: str) -> Any:
    """The method registered as ``name``; ValueError names the choices otherwise."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"reuse must be one of {names()}, got {name!r}") from None
