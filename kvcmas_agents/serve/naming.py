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
_NOT_NAME = re.compile(r"[^\w.:@/-]+")


def _checked(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise APIError(400, f"{what} must be 1-128 characters of letters, digits and _.:@/-, got {value!r}",
                       what, "invalid_value")
    return value


def name_from(value: str) -> str:
    """``value`` when it is a valid name, else a valid one derived from it deterministically: its slug
    plus a hash of the whole string (``"john doe"`` -> ``"john-doe-<10 hex>"``), so one caller keeps one name."""
    if _NAME_RE.match(value):
        return value
    slug = _NOT_NAME.sub("-", value).strip("-")[:100] or "user"
    return f"{slug}-{hashlib.sha256(value.encode()).hexdigest()[:10]}"


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
    """The ``X-KVCMAS-Agent`` header, else the ``user`` field (made a valid name, see ``name_from``), else
    ``metadata.agent``, else the system prompt's hash (``default`` without one)."""
    header = headers.get(AGENT_HEADER)
    if header:
        return _checked(header, "X-KVCMAS-Agent")
    if user:                 # OpenAI's user is any string: never rejected, mapped to a valid name
        return name_from(user)
    if metadata.get("agent"):
        return _checked(metadata["agent"], "metadata.agent")
    return derived_agent(messages)


def session_key(headers: Mapping[str, str], metadata: Mapping | None = None,
                cache_key: str | None = None) -> str | None:
    """The ``X-KVCMAS-Session`` header, else ``metadata.session``, else OpenAI's ``prompt_cache_key`` (a
    cache-routing hint, so it pins requests to one engine as a session does; made a valid name); None: the
    backend's default workflow."""
    value = headers.get(SESSION_HEADER) or (metadata or {}).get("session")
    if value:
        return _checked(value, "session")
    return name_from(cache_key) if cache_key else None
