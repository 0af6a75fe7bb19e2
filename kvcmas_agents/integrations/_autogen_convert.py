"""Conversion between AutoGen model types and the engine's OpenAI-style dicts and outputs."""
from __future__ import annotations

import json
from typing import Any, Iterator, Literal, Sequence

from autogen_core import FunctionCall, Image
from autogen_core.models import (
    AssistantMessage, CreateResult, FunctionExecutionResultMessage, LLMMessage, RequestUsage, SystemMessage,
    UserMessage,
)
from autogen_core.tools import Tool, ToolSchema
from autogen_core.utils import extract_json_from_str
from pydantic import BaseModel, ValidationError

from ..chat.tools import loads_lenient
from ..engine.outputs import RequestOutput


# --- messages ------------------------------------------------------------------------------
def to_engine_messages(messages: Sequence[LLMMessage]) -> list[dict[str, Any]]:
    """Convert AutoGen LLM messages to the engine's OpenAI-style message dicts."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, SystemMessage):
            out.append({"role": "system", "content": msg.content})
        elif isinstance(msg, UserMessage):
            out.append({"role": "user", "content": _user_text(i, msg), "name": msg.source})
        elif isinstance(msg, AssistantMessage):
            out.append(_assistant_dict(msg))
        elif isinstance(msg, FunctionExecutionResultMessage):
            out.extend({"role": "tool", "content": r.content, "tool_call_id": r.call_id} for r in msg.content)
        else:
            raise ValueError(f"messages[{i}]: unsupported message type {type(msg).__name__}")
    return out


def _user_text(i: int, msg: UserMessage) -> str:
    if isinstance(msg.content, str):
        return msg.content
    if any(isinstance(part, Image) for part in msg.content):
        raise ValueError(
            f"messages[{i}] (UserMessage from {msg.source!r}) contains an image: multimodal content is not "
            "supported by KVCMASClient (text-only models)")
    return "\n".join(str(part) for part in msg.content)


def _assistant_dict(msg: AssistantMessage) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
             for c in msg.content]
    return {"role": "assistant", "content": msg.thought or "", "tool_calls": calls}


def _arguments(raw: str) -> str | dict[str, Any]:
    # The engine rejects calls whose arguments are not a JSON object; keep bad ones visible instead.
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return {"raw_arguments": raw}
    return raw if isinstance(parsed, dict) else {"value": parsed}


# --- tools ---------------------------------------------------------------------------------
def to_engine_tools(tools: Sequence[Tool | ToolSchema]) -> list[dict[str, Any]]:
    """Convert AutoGen tools or tool schemas to OpenAI tool dicts."""
    out = []
    for tool in tools:
        schema: Any = tool.schema if isinstance(tool, Tool) else tool
        spec: dict[str, Any] = {"name": schema["name"], "description": schema.get("description", "")}
        if "parameters" in schema:
            spec["parameters"] = dict(schema["parameters"])
        out.append({"type": "function", "function": spec})
    return out


def to_engine_tool_choice(tool_choice: Tool | Literal["auto", "required", "none"],
                          tools: list[dict[str, Any]]) -> str:
    """Return the engine's tool_choice; a forced Tool must be one of ``tools``."""
    if isinstance(tool_choice, Tool):
        name = tool_choice.schema["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names tool {name!r}, which is not in tools")
        return name
    if tool_choice not in ("auto", "required", "none"):
        raise ValueError(f"tool_choice must be a Tool, 'auto', 'required' or 'none', got {tool_choice!r}")
    return tool_choice


# --- JSON output ---------------------------------------------------------------------------
def json_instruction(json_output: bool | type[BaseModel] | None) -> str:
    """The system instruction that asks for JSON (with the schema for structured output), or ""."""
    if json_output is None or json_output is False:
        return ""
    if json_output is True:
        return "Respond only with a single valid JSON object and no other text."
    schema = json.dumps(json_output.model_json_schema(), ensure_ascii=False)
    return ("Respond only with a single valid JSON object that conforms to this JSON schema, "
            f"and no other text:\n{schema}")


def response_format(json_output: bool | type[BaseModel] | None) -> dict[str, Any] | None:
    """The engine's ``response_format`` for ``json_output``: decoding is constrained to it."""
    if json_output is None or json_output is False:
        return None
    if json_output is True:
        return {"type": "json_object"}
    return {"type": "json_schema",
            "json_schema": {"name": json_output.__name__, "schema": json_output.model_json_schema()}}


def clean_json(text: str, json_output: bool | type[BaseModel]) -> str:
    """Best effort: the JSON in ``text`` (validated against the model type if given), else ``text``."""
    for value in _json_values(text):
        if isinstance(json_output, type):
            try:
                return json_output.model_validate(value).model_dump_json()
            except ValidationError:
                continue
        return json.dumps(value, ensure_ascii=False)
    return text


def _json_values(text: str) -> Iterator[Any]:
    # autogen-core's extractor reads the whole reply or each ``` fenced block; the chat layer's lenient
    # read also finds an object with prose around it, which the extractor does not.
    try:
        yield from extract_json_from_str(text.strip())
    except ValueError:              # not JSON, or a fence in another language
        pass
    try:
        yield loads_lenient(text)
    except ValueError:
        pass


# --- results -------------------------------------------------------------------------------
def to_create_result(out: RequestOutput, json_output: bool | type[BaseModel] | None = None) -> CreateResult:
    """Turn an engine output into a CreateResult; well-formed tool calls become FunctionCalls."""
    usage = RequestUsage(prompt_tokens=out.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens)
    if out.tool_calls:
        calls = [FunctionCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False))
                 for c in out.tool_calls]
        return CreateResult(finish_reason="function_calls", content=calls, usage=usage, cached=False,
                            thought=out.content or None)
    # Calls that failed to parse stay visible as text rather than becoming broken FunctionCalls.
    text = out.text if out.invalid_tool_calls else out.content
    if json_output:
        text = clean_json(text, json_output)
    reason = out.finish_reason if out.finish_reason in ("stop", "length") else "unknown"
    return CreateResult(finish_reason=reason, content=text, usage=usage, cached=False)
