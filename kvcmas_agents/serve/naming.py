"""Which agent and which workflow (session) a request belongs to.

The engine accounts KV reuse per agent, so every distinct role in a workflow needs a stable name. Clients
that cannot name their agents still get one: agents differ by their system prompt, so its hash is used.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping

from .errors import APIError

AGENT_HEADER = "x-kvcmas-agent"
SESSION_HEADER = "x-kvcmas-session"
DEFAULT_AGENT = "default"
_NAME_RE = re.compile(r"^[\w.:@/-]{1,128}$")


def _checked(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise APIError(400, f"{what} must be 1-128 characters of letters, digits and _.:@/-, got {value!r}",
                       what, "invalid_value")
    return value


def system_text(messages: list) -> str | None:
    """The first system (or developer) message's text, or None."""
    for msg in messages:
        if isinstance(msg, Mapping) and msg.get("role") in ("system", "developer"):
            content = msg.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
            return content if isinstance(content, str) else None
    return None


def derived_agent(messages: list) -> str:
    """``sys-<10 hex>`` from the system prompt, so the same prompt always maps to the same agent."""
    text = system_text(messages)
    if not text:
        return DEFAULT_AGENT
    return "sys-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def agent_name(headers: Mapping[str, str], user: str | None, metadata: Mapping, messages: list) -> str:
    """The ``X-KVCMAS-Agent`` header, else the ``user`` field, else ``metadata.agent``, else the
    system prompt's hash (``default`` without one)."""
    for value, what in ((headers.get(AGENT_HEADER), "X-KVCMAS-Agent"), (user, "user"),
                        (metadata.get("agent"), "metadata.agent")):
        if value:
            return _checked(value, what)
    return derived_agent(messages)


def session_key(headers: Mapping[str, str], metadata: Mapping | None = None) -> str | None:
    """The ``X-KVCMAS-Session`` header, else ``metadata.session``; None: the backend's default workflow."""
    value = headers.get(SESSION_HEADER) or (metadata or {}).get("session")
    return _checked(value, "session") if value else None
