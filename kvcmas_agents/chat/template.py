"""Chat message validation, template rendering and per-message token segments.

Segments let the engine cache KV per message: when a template is prefix-stable,
the tokens of message i depend only on messages[:i + 1].
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from ..errors import ContextLengthError, InvalidRequestError
from .tools import (check_tool_choice, format_tool_call, new_call_id, normalize_tools, tool_choice_instruction,
                    tool_instructions)

ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "</s>", "<end_of_turn>")


@dataclass
class Segment:
    """A token span of a rendered prompt.

    kind is "prefix" (leading system message), "message", or "suffix" (the
    generation prompt). message_index is None for the suffix, for an injected
    tool-instruction system message, and for the single segment of a prompt
    that is not prefix-stable.
    """

    start: int
    end: int
    kind: str
    role: str | None
    message_index: int | None

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class RenderedPrompt:
    """A tokenized prompt and its segments (which cover token_ids exactly, in order)."""

    token_ids: list[int]
    segments: list[Segment]
    prefix_stable: bool
    text: str


class ChatFormatter:
    """Validates OpenAI-style messages and renders them with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        self._native_tools = re.search(r"\btools\b", template) is not None
        self._native_tool_calls = "tool_calls" in template

    # -- validation -------------------------------------------------------

    def normalize(self, messages: Any) -> list[dict]:
        """Validate `messages` and return new normalized dicts.

        Output dicts have "role" (one of ROLES) and "content" (str), plus
        "tool_calls" (arguments as dicts), "tool_call_id" and "name" when given.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of message dicts")
        out = [_normalize_message(i, m) for i, m in enumerate(messages)]
        if all(not m["content"] and not m.get("tool_calls") for m in out):
            raise InvalidRequestError("all messages are empty")
        return out

    # -- rendering --------------------------------------------------------

    def render(
        self,
        messages: Any,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        *,
        tool_choice: Any = None,
    ) -> RenderedPrompt:
        """Render, tokenize and segment a conversation.

        Raises InvalidRequestError for bad input or a template error, and
        ContextLengthError when the prompt does not fit `max_context`.
        """
        msgs = self.normalize(messages)
        tool_specs = normalize_tools(tools) if tools else []
        prepared, owners = self._prepare(msgs, tool_specs, tool_choice)
        native = tool_specs if (tool_specs and self._native_tools) else None

        try:
            full = self._apply(prepared, native, add_generation_prompt)
        except Exception as exc:
            if not any(m["role"] == "tool" for m in prepared):
                raise InvalidRequestError(f"chat template failed: {exc}") from exc
            prepared = [_tool_as_user(m) for m in prepared]
            try:
                full = self._apply(prepared, native, add_generation_prompt)
            except Exception as exc2:
                raise InvalidRequestError(f"chat template failed: {exc2}") from exc2

        token_ids, offsets = self._tokenize(full)
        if len(token_ids) >= self.max_context:
            raise ContextLengthError(
                f"prompt is {len(token_ids)} tokens but the context window is {self.max_context} tokens"
            )
        segments = self._segments(prepared, owners, native, full, token_ids, offsets)
        stable = segments is not None
        if segments is None:
            segments = self._fallback_segments(prepared, native, full, add_generation_prompt, token_ids, offsets)
        return RenderedPrompt(token_ids=token_ids, segments=segments, prefix_stable=stable, text=full)

    @cached_property
    def stop_token_ids(self) -> set[int]:
        """EOS plus any end-of-turn tokens present in the vocabulary."""
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in STOP_TOKENS if t in vocab}
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    # -- internals --------------------------------------------------------

    def _prepare(
        self, msgs: list[dict], tool_specs: list[dict], tool_choice: Any
    ) -> tuple[list[dict], list[int | None]]:
        """Adapt messages to the template; return them and each one's source index."""
        prepared: list[dict] = []
        for m in msgs:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if calls and self._native_tool_calls:
                m["tool_calls"] = calls
            elif calls:
                # The template can't show calls, so inline them in the documented format.
                text = "\n".join(format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
                m["content"] = f"{m['content']}\n{text}" if m["content"] else text
            prepared.append(m)
        owners: list[int | None] = list(range(len(prepared)))

        check_tool_choice(tool_choice, tool_specs)
        extra = ""
        if tool_specs and not self._native_tools:
            extra = tool_instructions(tool_specs, tool_choice)
        elif tool_specs:
            extra = tool_choice_instruction(tool_choice)
        with_extra = with_system_text(prepared, extra)
        if len(with_extra) > len(prepared):
            owners.insert(0, None)
        return with_extra, owners

    def _apply(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = tools
        text = self.tokenizer.apply_chat_template(msgs, **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """Token ids of `text` (no added special tokens) and char offsets when available."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        except (NotImplementedError, KeyError, ValueError, TypeError):
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None

    def _char_to_token(
        self, boundary: int, text: str, token_ids: list[int], offsets: list[tuple[int, int]] | None
    ) -> int | None:
        """Token index where char `boundary` starts, or None if it falls inside a token."""
        if boundary == 0:
            return 0
        if boundary == len(text):
            return len(token_ids)
        if offsets is None:
            # Slow tokenizer: accept only if the head tokenizes to exactly the leading ids.
            head = self.tokenizer.encode(text[:boundary], add_special_tokens=False)
            return len(head) if list(head) == token_ids[: len(head)] else None
        k = next((i for i, (s, e) in enumerate(offsets) if s >= boundary and e > s), len(offsets))
        if any(e > boundary for s, e in offsets[:k] if e > s):
            return None
        return k

    def _segments(
        self,
        prepared: list[dict],
        owners: list[int | None],
        tools: list[dict] | None,
        full: str,
        token_ids: list[int],
        offsets: list[tuple[int, int]] | None,
    ) -> list[Segment] | None:
        """Per-message segments, or None when the template is not prefix-stable."""
        try:
            partial = [self._apply(prepared[: i + 1], tools, False) for i in range(len(prepared))]
        except Exception:
            return None
        char_bounds = [0] + [len(r) for r in partial]
        for prev, cur in zip([""] + partial, partial + [full]):
            if not cur.startswith(prev):
                return None
        tok_bounds = []
        for b in char_bounds:
            t = self._char_to_token(b, full, token_ids, offsets)
            if t is None:
                return None
            tok_bounds.append(t)

        segments = []
        for i, m in enumerate(prepared):
            kind = "prefix" if i == 0 and m["role"] == "system" else "message"
            segments.append(Segment(tok_bounds[i], tok_bounds[i + 1], kind, m["role"], owners[i]))
        if tok_bounds[-1] < len(token_ids):
            segments.append(Segment(tok_bounds[-1], len(token_ids), "suffix", None, None))
        return segments

    def _fallback_segments(
        self,
        prepared: list[dict],
        tools: list[dict] | None,
        full: str,
        add_generation_prompt: bool,
        token_ids: list[int],
        offsets: list[tuple[int, int]] | None,
    ) -> list[Segment]:
        """One segment for all messages, split off the generation prompt when possible."""
        n = len(token_ids)
        split = n
        if add_generation_prompt:
            try:
                body = self._apply(prepared, tools, False)
            except Exception:
                body = None
            if body is not None and full.startswith(body):
                split = self._char_to_token(len(body), full, token_ids, offsets) or n
        segments = [Segment(0, split, "message", None, None)]
        if split < n:
            segments.append(Segment(split, n, "suffix", None, None))
        return segments


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` appended to the leading system message, or in a new one in front.

    The adapters add their structured-output instructions this way, and the formatter its tool text.
    """
    if not text:
        return messages
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        head = messages[0]["content"]
        return [{**messages[0], "content": f"{head}\n\n{text}" if head else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _normalize_message(i: int, msg: Any) -> dict:
    if not isinstance(msg, Mapping):
        raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
    role = msg.get("role")
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise InvalidRequestError(
            f"messages[{i}] has unknown role {msg.get('role')!r}; expected one of system, developer, user, assistant, tool"
        )
    out: dict[str, Any] = {"role": role}

    calls = msg.get("tool_calls")
    if calls is not None and role != "assistant":
        raise InvalidRequestError(f"messages[{i}]: only assistant messages may have tool_calls")
    if calls is not None:
        if not isinstance(calls, (list, tuple)):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a list")
        if calls:
            out["tool_calls"] = [_normalize_tool_call(i, j, c) for j, c in enumerate(calls)]

    content = msg.get("content")
    if content is None:
        if "tool_calls" not in out:
            raise InvalidRequestError(f"messages[{i}] ({role}) has no content")
        content = ""
    out["content"] = _normalize_content(i, content)

    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string")
            out["tool_call_id"] = call_id
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequestError(f"messages[{i}].name must be a string")
        out["name"] = name
    return out


def _normalize_content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise InvalidRequestError(f"messages[{i}].content[{j}] must be a content-part dict")
            if part.get("type") != "text":
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] has type {part.get('type')!r}: multimodal content is not supported"
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content[{j}] needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _normalize_tool_call(i: int, j: int, call: Any) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{where} must be a dict")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}: unsupported type {call.get('type')!r}")
    call_id = call.get("id")
    if call_id is None:
        call_id = new_call_id()
    elif not isinstance(call_id, str):
        raise InvalidRequestError(f"{where}.id must be a string")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidRequestError(f"{where} needs a 'function' dict")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.function needs a non-empty string 'name'")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
    if not isinstance(args, Mapping):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": dict(args)}}


def _tool_as_user(msg: dict) -> dict:
    """Fallback for templates that reject the tool role."""
    if msg["role"] != "tool":
        return msg
    return {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
