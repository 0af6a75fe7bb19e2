"""Conversions between LangChain messages and the engine's OpenAI-style dicts and outputs."""
from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
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
_NAMED_ROLES = ("user", "assistant", "tool")   # the roles whose ``name`` says which agent or tool spoke


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages to the engine's OpenAI-style message dicts.

    Raises ValueError for content the text-only engine cannot take (images, audio, files).
    """
    return [_convert(i, m) for i, m in enumerate(messages)]


def _convert(i: int, msg: BaseMessage) -> dict[str, Any]:
    # LangChain's own converter does roles, tool calls and tool-call ids. On top of it: content stays a
    # list of blocks and its text blocks are joined with no separator (its "string" format joins them with
    # newlines, which would change text that streaming split into blocks); reasoning and tool-use blocks
    # are dropped and media rejected (text-only models); a FunctionMessage becomes a tool result (the
    # engine has no "function" role); names are kept only where they name an agent or a tool, and ids the
    # messages do not have are left out (the engine makes its own). Unknown ChatMessage roles are passed
    # on for the engine to reject with its own error.
    try:
        d = convert_to_openai_messages(msg, text_format="block")
    except ValueError as exc:       # e.g. a BaseMessage subclass it does not know
        raise ValueError(f"messages[{i}]: unsupported message: {exc}") from exc
    role = "tool" if d["role"] == "function" else d["role"]
    out: dict[str, Any] = {"role": role}
    if d.get("tool_calls"):
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id" or v} for c in d["tool_calls"]]
    if "tool_call_id" in d:
        out["tool_call_id"] = d["tool_call_id"]
    out["content"] = _text_content(i, d["content"])
    if d.get("name") and role in _NAMED_ROLES:
        out["name"] = d["name"]
    return out


def _text_content(i: int, content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
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
