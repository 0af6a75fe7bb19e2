"""Structured output: OpenAI-style ``response_format``, which the engine enforces while decoding
(grammar-constrained), and a system instruction that tells the model what to put in the JSON.
"""
from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, Literal

from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

StructuredMethod = Literal["function_calling", "json_schema", "json_mode"]


def response_format_for(schema: Any, method: StructuredMethod) -> dict[str, Any]:
    """The OpenAI-style ``response_format`` for a JSON method."""
    if method == "json_mode":
        return {"type": "json_object"}
    if schema is None:
        raise ValueError("method='json_schema' needs a schema")
    json_schema = convert_to_json_schema(schema)
    return {"type": "json_schema",
            "json_schema": {"name": json_schema.get("title", "output"), "schema": json_schema}}


def format_instruction(response_format: Any) -> str:
    """System-prompt text for an OpenAI-style ``response_format`` ("" for plain text)."""
    if response_format is None:
        return ""
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(f"response_format must be a dict with a 'type', got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return "Reply with only a valid JSON object, no other text."
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        return _schema_instruction(spec.get("schema", spec))
    raise ValueError(f"unsupported response_format type {kind!r}; use 'text', 'json_object' or 'json_schema'")


def _schema_instruction(schema: dict[str, Any]) -> str:
    # Small models tend to echo a whole schema back; listing an object's properties works better.
    props = schema.get("properties")
    if schema.get("type") != "object" or not isinstance(props, dict):
        return f"Reply with only JSON, no other text, that is valid against this JSON schema: {_dumps(schema)}"
    text = f"Reply with only a JSON object, no other text. Its properties, as JSON schema: {_dumps(props)}."
    if schema.get("required"):
        text += f" Required: {', '.join(schema['required'])}."
    if schema.get("$defs"):
        text += f" Definitions: {_dumps(schema['$defs'])}."
    return text


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def json_parser(schema: Any) -> OutputParserLike:
    """Parse JSON text into the schema's pydantic class, or into a dict."""
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        return PydanticOutputParser(pydantic_object=schema)
    return JsonOutputParser()


def attach_parser(llm: Runnable, parser: Runnable, include_raw: bool) -> Runnable:
    """``llm | parser``, or a map of raw/parsed/parsing_error when ``include_raw``."""
    if not include_raw:
        return llm | parser
    parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")
