"""Conversions between LangChain messages and the engine's OpenAI-style dicts and outputs."""
from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.json import parse_partial_json

from ..chat.tools import TOOL_CALL_OPEN, InvalidToolCall, format_tool_call
from ..engine import RequestOutput

PROVIDER = "kvcmas"

# Blocks that restate what the message carries elsewhere (tool calls) or that the model never sees.
_SKIPPED_BLOCKS = frozenset({
    "tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call", "function_call",
    "reasoning", "thinking", "redacted_thinking",
})
_MEDIA_BLOCKS = frozenset({"image", "image_url", "input_image", "file", "input_file", "audio", "input_audio",
                           "video", "document", "media"})


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages to the engine's OpenAI-style message dicts.

    Raises ValueError for content the text-only engine cannot take (images, audio, files).
    """
    return [_convert(i, m) for i, m in enumerate(messages)]


def _convert(i: int, msg: BaseMessage) -> dict[str, Any]:
    if isinstance(msg, SystemMessage):
        out: dict[str, Any] = {"role": "system"}
    elif isinstance(msg, HumanMessage):
        out = {"role": "user"}
    elif isinstance(msg, AIMessage):
        out = {"role": "assistant"}
        if msg.tool_calls:
            out["tool_calls"] = [_openai_call(tc) for tc in msg.tool_calls]
    elif isinstance(msg, ToolMessage):
        out = {"role": "tool", "tool_call_id": msg.tool_call_id}
    elif isinstance(msg, ChatMessage):
        out = {"role": msg.role}   # unknown roles are rejected by the engine with a clear error
    elif isinstance(msg, FunctionMessage):
        out = {"role": "tool"}
    else:
        raise ValueError(f"messages[{i}]: unsupported message type {type(msg).__name__}")
    out["content"] = _text_content(i, msg)
    if msg.name and out["role"] in ("user", "assistant", "tool"):
        out["name"] = msg.name
    return out


def _openai_call(tc: dict[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function",
                            "function": {"name": tc["name"], "arguments": json.dumps(tc["args"], ensure_ascii=False)}}
    if tc.get("id"):
        call["id"] = tc["id"]
    return call


def _text_content(i: int, msg: BaseMessage) -> str:
    content = msg.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for j, block in enumerate(content):
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind in _SKIPPED_BLOCKS:
            continue
        elif kind in _MEDIA_BLOCKS:
            raise ValueError(
                f"messages[{i}].content[{j}] is a {kind!r} block, but ChatKVCMAS serves text-only models; "
                "send text content only")
        else:
            raise ValueError(f"messages[{i}].content[{j}]: unsupported content block type {kind!r}")
    return "".join(parts)


def usage_metadata(out: RequestOutput) -> UsageMetadata:
    """LangChain usage for one request; ``cache_read`` counts the prompt tokens whose stored KV served it
    as is: exact prefix hits plus reused tokens that were not recomputed (the split is in response_metadata)."""
    u = out.usage
    return UsageMetadata(
        input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
        input_token_details=InputTokenDetails(cache_read=u.kept_tokens),
    )


def response_metadata(out: RequestOutput, model_name: str) -> dict[str, Any]:
    """Provider metadata: finish reason, latency and the engine's reuse accounting."""
    u = out.usage
    return {
        "model_name": model_name, "model_provider": PROVIDER, "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason, "agent": out.agent, "request_id": out.request_id,
        "ttft_s": out.ttft_s, "latency_s": out.latency_s, "reuse": out.reuse, "prefix_stable": out.prefix_stable,
        "cached_tokens": u.cached_tokens, "reused_tokens": u.reused_tokens, "recomputed_tokens": u.recomputed_tokens,
    }


def ai_message(out: RequestOutput, model_name: str) -> AIMessage:
    """The AIMessage for a finished request."""
    return AIMessage(
        content=out.content,
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in out.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=unusable_args(c), id=c.id, error=c.error)
                            for c in out.invalid_tool_calls],
        usage_metadata=usage_metadata(out),
        response_metadata=response_metadata(out, model_name),
    )


def final_chunk(text: str, out: RequestOutput, model_name: str) -> AIMessageChunk:
    """The last streamed chunk: remaining text, tool calls as chunks, usage and finish reason."""
    chunks = [tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id, index=k)
              for k, c in enumerate(out.tool_calls)]
    chunks += [tool_call_chunk(name=c.name, args=unusable_args(c), id=c.id, index=len(chunks) + k)
               for k, c in enumerate(out.invalid_tool_calls)]
    return AIMessageChunk(
        content=text, tool_call_chunks=chunks, usage_metadata=usage_metadata(out),
        response_metadata=response_metadata(out, model_name), chunk_position="last",
    )


def unusable_args(call: InvalidToolCall) -> str:
    """An invalid call's ``args`` in a form LangChain keeps invalid, the same streamed or not.

    Merged stream chunks are re-parsed with LangChain's lenient partial-JSON parser, which reads a
    cut-off block (``{"name": "f", "argu``) or the arguments of a call to an unknown tool as a valid
    call. Raw text it cannot read that way is passed as is; otherwise the call is shown as the model
    wrote it, in its ``<tool_call>`` format (the tag keeps it from parsing).
    """
    raw = call.arguments or ""
    try:
        readable = not raw or isinstance(parse_partial_json(raw), dict)
    except ValueError:
        readable = False
    if not readable:
        return raw
    try:
        return format_tool_call(call.name or "", json.loads(raw) if raw else {})
    except ValueError:   # cut off: the block as far as the model got
        return TOOL_CALL_OPEN + raw
