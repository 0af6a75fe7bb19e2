"""Tool definitions and tool-call parsing for models without structured tool output.

The wire format the model is taught (and that past calls are rendered in) is one
block per call::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_FENCE_RE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')


@dataclass
class ToolCall:
    """A well-formed call to a known tool."""

    id: str
    name: str
    arguments: dict


@dataclass
class InvalidToolCall:
    """A call block the model emitted that could not be used; `error` says why."""

    id: str | None
    name: str | None
    arguments: str | None
    error: str


@dataclass
class ParsedOutput:
    """Model output split into plain text and tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def new_call_id() -> str:
    """Return a fresh OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def normalize_tools(tools: Any) -> list[dict]:
    """Validate tool definitions and return them in OpenAI form.

    Accepts ``{"type": "function", "function": {...}}`` or a bare
    ``{"name", "description", "parameters"}`` dict per tool. ``None`` gives ``[]``.
    """
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list, got {type(tools).__name__}")
    out: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise InvalidRequestError(f"tools[{i}]: unsupported tool type {tool.get('type')!r}")
            spec = tool["function"]
            if not isinstance(spec, Mapping):
                raise InvalidRequestError(f"tools[{i}].function must be a dict")
        else:
            spec = tool
        name = spec.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"tools[{i}] needs a non-empty string 'name'")
        if name in seen:
            raise InvalidRequestError(f"tools[{i}]: duplicate tool name {name!r}")
        seen.add(name)
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"tools[{i}] ({name}): 'description' must be a string")
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = dict(_DEFAULT_PARAMETERS)
        elif not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{i}] ({name}): 'parameters' must be a JSON-schema dict")
        out.append(
            {
                "type": "function",
                "function": {"name": name, "description": description, "parameters": dict(parameters)},
            }
        )
    return out


def check_tool_choice(tool_choice: Any, tool_specs: list[dict]) -> None:
    """Raise InvalidRequestError unless ``tool_choice`` is a mode or names one of ``tool_specs``."""
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if name is None or name in ("auto", "none"):
        return
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"invalid tool_choice {tool_choice!r}")
    known = [spec["function"]["name"] for spec in tool_specs]
    if name in ("required", "any"):
        if not known:
            raise InvalidRequestError(f"tool_choice={name!r} needs tools")
        return
    if name not in known:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools {known}")


def tool_choice_instruction(tool_choice: Any) -> str:
    """Return the sentence that enforces `tool_choice`, or "" when the model may choose.

    Accepts "auto"/"none"/None (no sentence), "required"/"any", a tool name, or
    OpenAI's ``{"type": "function", "function": {"name": ...}}``.
    """
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        tool_choice = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return ""
    if not isinstance(tool_choice, str) or not tool_choice:
        raise InvalidRequestError(f"invalid tool_choice {tool_choice!r}")
    if tool_choice in ("required", "any"):
        return "You must call at least one tool in your reply."
    return f"You must call the tool {tool_choice!r} in your reply."


def tool_instructions(tools: Any, tool_choice: Any = None) -> str:
    """System-prompt text that describes `tools` and the <tool_call> format."""
    specs = normalize_tools(tools)
    lines = [
        "You can call the following tools. Each tool is described as a JSON schema:",
        "<tools>",
        *(json.dumps(t["function"], ensure_ascii=False) for t in specs),
        "</tools>",
        "",
        "To call a tool, write each call on its own line in exactly this format:",
        format_tool_call("<tool name>", {"<argument name>": "<value>"}),
        "The arguments must be a JSON object that matches the tool's parameters. "
        "Tool results are given back to you in a following message. "
        "If no tool is needed, answer normally without any <tool_call> block.",
    ]
    choice = tool_choice_instruction(tool_choice)
    if choice:
        lines.append(choice)
    return "\n".join(lines)


def format_tool_call(name: str, arguments: Mapping[str, Any] | str | None) -> str:
    """Render one call in the <tool_call> format (used for past assistant turns)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the raw string; the model still sees what it sent
    payload = {"name": name, "arguments": arguments if arguments is not None else {}}
    return TOOL_CALL_OPEN + json.dumps(payload, ensure_ascii=False) + TOOL_CALL_CLOSE


def parse_tool_calls(text: str, tool_names: set[str] | None = None, cut: bool = False) -> ParsedOutput:
    """Split model output into content and tool calls; never raises.

    Recognises <tool_call> blocks (the last one may be unterminated) and, when
    `tool_names` is given, a reply that is only a JSON call object (optionally
    in a ``` fence) naming a known tool. ``cut``: the reply was cut by max_tokens;
    an unterminated last block that is no call then stays in the content, as written
    (its partial arguments), and its InvalidToolCall says it was cut.
    """
    blocks, content = _split_blocks(text)
    result = ParsedOutput(content=content)
    if blocks:
        for body in blocks:
            calls, invalid = len(result.tool_calls), len(result.invalid_tool_calls)
            _parse_block(body, tool_names, result)
        tail = text.rfind(TOOL_CALL_OPEN)
        if cut and text.find(TOOL_CALL_CLOSE, tail) < 0 and len(result.tool_calls) == calls:
            result.content += text[tail:]
            for bad in result.invalid_tool_calls[invalid:]:
                bad.error = f"cut off by max_tokens before the call was complete ({bad.error})"
        return result
    if tool_names:
        whole = _bare_json_calls(text, tool_names)
        if whole:
            return ParsedOutput(content="", tool_calls=whole)
    return result


def _split_blocks(text: str) -> tuple[list[str], str]:
    """Return the bodies of <tool_call> blocks and the text outside them."""
    blocks: list[str] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            kept.append(text[pos:])
            break
        kept.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:  # generation stopped inside the block
            blocks.append(text[body_start:])
            break
        blocks.append(text[body_start:end])
        pos = end + len(TOOL_CALL_CLOSE)
    content = "".join(kept).replace(TOOL_CALL_CLOSE, "")
    return blocks, content.strip()


def _strip_fence(text: str) -> str:
    text = text.strip()
    m = _FENCE_RE.match(text)
    return m.group(1).strip() if m else text


def loads_lenient(body: str) -> Any:
    """json.loads of ``body`` (a fence around it dropped), retrying on the outermost {...} span to drop
    stray text around an object."""
    body = _strip_fence(body)
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        first, last = body.find("{"), body.rfind("}")
        if 0 <= first < last:
            return json.loads(body[first : last + 1])
        raise


def _parse_block(body: str, tool_names: set[str] | None, out: ParsedOutput) -> None:
    raw = body.strip()
    try:
        obj = loads_lenient(raw)
    except json.JSONDecodeError as exc:
        m = _NAME_RE.search(raw)
        out.invalid_tool_calls.append(
            InvalidToolCall(new_call_id(), m.group(1) if m else None, raw, f"invalid JSON in tool call: {exc}")
        )
        return
    for item in obj if isinstance(obj, list) else [obj]:
        call = _call_from_obj(item, tool_names)
        if isinstance(call, ToolCall):
            out.tool_calls.append(call)
        else:
            out.invalid_tool_calls.append(call)


def _call_from_obj(obj: Any, tool_names: set[str] | None) -> ToolCall | InvalidToolCall:
    if not isinstance(obj, dict):
        return InvalidToolCall(new_call_id(), None, json.dumps(obj), "tool call must be a JSON object")
    if isinstance(obj.get("function"), dict):  # OpenAI-shaped call
        obj = {**obj["function"], "id": obj.get("id")}
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else new_call_id()
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    raw_args = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    if not isinstance(name, str) or not name:
        return InvalidToolCall(call_id, None, raw_args, "tool call has no 'name'")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return InvalidToolCall(call_id, name, raw_args, f"arguments are not valid JSON: {exc}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return InvalidToolCall(call_id, name, raw_args, "arguments must be a JSON object")
    if tool_names is not None and name not in tool_names:
        return InvalidToolCall(call_id, name, raw_args, f"unknown tool {name!r}")
    return ToolCall(call_id, name, args)


def _bare_json_calls(text: str, tool_names: set[str]) -> list[ToolCall]:
    """Calls from a reply that is nothing but JSON call object(s); [] otherwise."""
    try:
        obj = json.loads(_strip_fence(text))
    except json.JSONDecodeError:
        return []
    items = obj if isinstance(obj, list) and obj else [obj]
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict) or not ({"arguments", "parameters"} & item.keys()):
            return []
        call = _call_from_obj(item, tool_names)
        if not isinstance(call, ToolCall):
            return []  # plain JSON answer, not a call
        calls.append(call)
    return calls
