"""The gateway's settings (what ``kvcmas serve`` options set)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServeConfig:
    """Settings of the HTTP app, independent of the backend behind it.

    api_key: when set, every /v1 and /metrics request needs ``Authorization: Bearer <api_key>``.
    max_body_bytes: larger request bodies are refused with 413 before they are parsed.
    max_prompt_tokens: prompts longer than this (or than the model's context) get 400
        ``context_length_exceeded``; None means the model's context window.
    default_max_tokens: completion cap when a request names none.
    model_name: the id /v1/models lists and responses carry (default: the backend's model name).
    model_aliases: more ids requests may name (e.g. the id a client hard-codes). Besides these, the
        backend's model name and, for the default model, ``HuggingFaceTB/SmolLM2-135M-Instruct`` are
        accepted; any other model is a 404 ``model_not_found`` (serve/models.py).
    disconnect_poll_s: how often a non-streaming request checks whether its client went away.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 512
    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    disconnect_poll_s: float = 0.1
    graceful_shutdown_s: float = 30.0
