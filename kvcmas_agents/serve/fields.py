"""Which chat-completions request fields the gateway implements; every other field is a 400 naming it,
so no request is run with a setting silently dropped (OpenAI answers unknown fields the same way)."""
from __future__ import annotations

from typing import Any, Mapping

from .errors import APIError

IMPLEMENTED = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "metadata",
    "prompt_cache_key", "modalities", "store", "service_tier",
})
EXTENSIONS = frozenset({"top_k", "ignore_eos"})          # as vLLM's
# OpenAI fields this server cannot honour, and why.
UNSUPPORTED = {
    "audio": "audio output is not supported (text-only model)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated functions API is not supported; send tools",
    "function_call": "the deprecated function_call is not supported; send tool_choice",
    "reasoning_effort": "reasoning_effort is not supported: the model is not a reasoning model",
    "verbosity": "verbosity is not supported by this model",
    "safety_identifier": "safety_identifier is not supported: this server has no abuse monitoring",
}
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


def _reject(param: str, message: str) -> APIError:
    return APIError(400, message, param, "unsupported_parameter")


def check_fields(body: Mapping[str, Any]) -> None:
    """Raise APIError(400) for the first field (or value) this server does not implement."""
    for key, value in body.items():
        if key in UNSUPPORTED and value is not None:
            raise _reject(key, UNSUPPORTED[key])
        if key not in IMPLEMENTED and key not in EXTENSIONS and key not in UNSUPPORTED:
            raise _reject(key, f"unrecognized request argument: {key}")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _reject("modalities", f"only modalities=['text'] is supported, got {modalities!r}")
    if body.get("store"):
        raise _reject("store", "store=true is not supported: completions are not stored")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise _reject("service_tier", f"service_tier must be 'auto' or 'default' (one tier), got {tier!r}")
    options = body.get("stream_options")
    if isinstance(options, Mapping):
        unknown = sorted(set(options) - STREAM_OPTIONS)
        if unknown:
            raise _reject("stream_options", f"unrecognized stream_options: {unknown}")
        if options.get("include_obfuscation"):
            raise _reject("stream_options", "stream_options.include_obfuscation=true is not supported")
        if options and not body.get("stream"):
            raise APIError(400, "stream_options needs stream=true", "stream_options", "invalid_value")
