"""What a request's output is constrained to: an OpenAI-style ``response_format``, or a tool call
that ``tool_choice`` forces, as a ``GrammarSpec`` for grammar-constrained decoding."""
from __future__ import annotations

from typing import Any, Mapping

from ..chat.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, check_tool_choice, normalize_tools
from ..errors import InvalidRequestError
from ..model.grammar import GrammarSpec

ANY_TOOL = ("required", "any")


def grammar_spec(response_format: Mapping[str, Any] | None, tools: Any, tool_choice: Any) -> GrammarSpec | None:
    """The request's grammar, or None for free text. Raises InvalidRequestError on a bad request."""
    json_spec = _response_format_spec(response_format)
    tool_spec = _tool_call_spec(tools, tool_choice)
    if json_spec is not None and tool_spec is not None:
        raise InvalidRequestError("response_format and a forced tool_choice cannot both constrain one reply")
    return json_spec or tool_spec


def _response_format_spec(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.of({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidRequestError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        return GrammarSpec.of(schema)
    raise InvalidRequestError(f"unsupported response_format {response_format!r}; "
                              "use type 'text', 'json_object' or 'json_schema'")


def forced_tool(tool_choice: Any) -> str | None:
    """The tool name ``tool_choice`` forces, "required" for any tool, or None when the model may choose."""
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        tool_choice = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not isinstance(tool_choice, str) or not tool_choice:
        raise InvalidRequestError(f"invalid tool_choice {tool_choice!r}")
    return "required" if tool_choice in ANY_TOOL else tool_choice


def _tool_call_spec(tools: Any, tool_choice: Any) -> GrammarSpec | None:
    forced = forced_tool(tool_choice)
    if forced is None:
        return None
    normalized = normalize_tools(tools)
    check_tool_choice(tool_choice, normalized)          # the chat layer's check: a forced tool must be given
    specs = {t["function"]["name"]: t["function"] for t in normalized}
    names = list(specs) if forced == "required" else [forced]
    defs: dict[str, Any] = {}
    calls = [_call_schema(name, specs[name]["parameters"], defs) for name in names]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    # One call block in the wire format chat/tools.py parses: <tool_call>{"name", "arguments"}</tool_call>
    return GrammarSpec.of(schema, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


def _call_schema(name: str, parameters: Mapping[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call object; the parameters' "$defs" move to the root, where their
    "#/$defs/..." references point once the parameters are nested under "arguments"."""
    params = dict(parameters)
    for key, value in (params.pop("$defs", None) or {}).items():
        if key in defs and defs[key] != value:
            raise InvalidRequestError(f"tools define $defs {key!r} differently; rename one to force any tool")
        defs[key] = value
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"]}
