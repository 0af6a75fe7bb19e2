"""OpenAI chat-completions wire format: the request parsed into engine arguments, and the engine's output
turned into a ``chat.completion`` or ``chat.completion.chunk`` objects.

Messages, tools, tool_choice and response_format are passed to the engine as OpenAI sent them: the chat
layer validates them (unknown roles, malformed tool calls, bad schemas raise InvalidRequestError -> 400).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..engine import RequestOutput, SamplingParams
from ..chat.tools import ToolCall
from ..engine.config import MAX_LOGIT_BIAS
from ..engine.logprobs import Logprob
from .errors import APIError
from .fields import check_fields

# JSON has no -inf: a token the grammar forbids gets OpenAI's floor for "never".
LOGPROB_FLOOR = -9999.0

@dataclass
class ChatRequest:
    """What one ``POST /v1/chat/completions`` asks the backend for."""

    model: str
    messages: list
    sampling: SamplingParams
    tools: list | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    metadata: dict = field(default_factory=dict)
    parallel_tool_calls: bool = True      # False: at most one tool call per reply
    prompt_cache_key: str | None = None


def _number(body: Mapping, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise APIError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", key, "invalid_value")
    return float(value)


def _int(body: Mapping, key: str, lo: int = 0) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise APIError(400, f"{key} must be an integer >= {lo}, got {value!r}", key, "invalid_value")
    return value


def _logit_bias(body: Mapping) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias",
                       "invalid_value")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (str(key).isascii() and str(key).isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias", "invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}",
                           "logit_bias", "invalid_value")
        out[int(key)] = float(value)
    return out


def _logprobs(body: Mapping) -> tuple[bool, int]:
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise APIError(400, f"logprobs must be a boolean, got {want!r}", "logprobs", "invalid_value")
    top = _int(body, "top_logprobs")
    if top is not None and top > 20:
        raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {top}", "top_logprobs",
                       "invalid_value")
    if top and not want:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
    return bool(want), top or 0


def _optional(body: Mapping, key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise APIError(400, f"{key} must be a {kind.__name__}, got {value!r}", key, "invalid_value")
    return value


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """Validate a decoded request body; raise APIError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_request")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array", "messages", "invalid_messages")
    check_fields(body)
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise APIError(400, f"only n=1 is supported, got n={n}", "n", "unsupported_value")
    logprobs, top_logprobs = _logprobs(body)
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "stop must be a string or an array of strings", "stop", "invalid_value")
    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise APIError(400, "response_format must be an object", "response_format", "invalid_value")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        response_format = None
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be an array", "tools", "invalid_value")
    if not tools and body.get("tool_choice") not in (None, "none", "auto"):
        raise APIError(400, f"tool_choice {body['tool_choice']!r} needs tools", "tool_choice", "invalid_value")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise APIError(400, "stream must be a boolean and stream_options an object", "stream", "invalid_value")
    metadata = _optional(body, "metadata", dict) or {}
    user = _optional(body, "user", str)
    parallel = _optional(body, "parallel_tool_calls", bool)
    ignore_eos = body.get("ignore_eos", False)          # extension, as vLLM's
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos must be a boolean", "ignore_eos", "invalid_value")
    sampling = SamplingParams(
        max_tokens=max_tokens or default_max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_int(body, "top_k") or 0,
        seed=_int(body, "seed", -2**63),
        stop=stop or [],
        response_format=response_format,
        ignore_eos=ignore_eos,
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    model = body.get("model")
    return ChatRequest(model=model if isinstance(model, str) else "", messages=messages, sampling=sampling,
                       tools=tools or None, tool_choice=body.get("tool_choice") if tools else None,
                       stream=stream, include_usage=bool(options.get("include_usage")), user=user,
                       metadata=metadata, parallel_tool_calls=parallel is not False,
                       prompt_cache_key=_optional(body, "prompt_cache_key", str))


def tool_names(tools: list | None) -> set[str] | None:
    """The names of a request's tools (None without tools)."""
    if not tools:
        return None
    return {t.get("function", t).get("name") for t in tools if isinstance(t, dict)
            and isinstance(t.get("function", t), dict)}


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    """One OpenAI tool call (``index`` set for a streamed delta); arguments as a JSON string."""
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    return out if index is None else {"index": index, **out}


def finish_reason(output: RequestOutput) -> str:
    if output.tool_calls:
        return "tool_calls"
    return "length" if output.finish_reason == "length" else "stop"


def usage_json(output: RequestOutput) -> dict:
    """OpenAI usage; ``cached_tokens`` counts prompt tokens whose KV was not recomputed (kept tokens):
    exact prefix hits plus KV reused from other agents as is. ``kvcmas`` breaks that down."""
    u = output.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.kept_tokens},
            "kvcmas": {"prefix_cached_tokens": u.cached_tokens, "reused_tokens": u.reused_tokens,
                       "recomputed_tokens": u.recomputed_tokens, "kept_tokens": u.kept_tokens,
                       "reuse": output.reuse, "agent": output.agent, "ttft_s": round(output.ttft_s, 6)}}


def logprobs_json(entries: list[Logprob] | None) -> dict | None:
    """OpenAI's ``choices[i].logprobs``: one ``content`` entry per generated token."""
    if entries is None:
        return None

    def one(token: str, logprob: float, raw: list[int]) -> dict:
        return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": raw}

    return {"content": [{**one(e.token, e.logprob, e.bytes),
                         "top_logprobs": [one(t.token, t.logprob, t.bytes) for t in e.top_logprobs]}
                        for e in entries], "refusal": None}


def completion_json(cid: str, model: str, output: RequestOutput, parallel_tool_calls: bool = True) -> dict:
    """The ``chat.completion`` object for a finished request (with ``parallel_tool_calls=False``, the
    first tool call only)."""
    message: dict[str, Any] = {"role": "assistant", "content": output.content}
    calls = output.tool_calls if parallel_tool_calls else output.tool_calls[:1]
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
        message["content"] = output.content or None
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(output),
                         "logprobs": logprobs_json(output.logprobs)}],
            "usage": usage_json(output)}


def chunk_json(cid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               usage: dict | None = None, with_usage: bool = False, logprobs: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (no choices)."""
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [] if delta is None else
                           [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
    if with_usage:
        out["usage"] = usage
    return out
