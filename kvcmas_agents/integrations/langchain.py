"""LangChain chat model backed by the process-wide embedded kvcmas engine."""
from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field, model_validator

from ..chat.template import with_system_text
from ..engine import Engine, ReuseOptions, SamplingParams, ToolDecision
from ..engine.tool_decision import DEFAULT_THRESHOLD
from ..model.loader import DEFAULT_MODEL
from ..registry import ADAPTER_REUSE, get_engine
from . import _lc_messages as conv
from . import _lc_structured as structured
from ._lc_sync import iterate_sync
from ._reuse import LEGACY_KNOBS, fold_legacy, override, to_options
from ..chat.tool_filter import ToolBlockFilter

DEFAULT_AGENT = "default"
_SAMPLING_KEYS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                  "logit_bias")
_IGNORED_KEYS = ("stream", "parallel_tool_calls", "strict")   # accepted for API compatibility; no effect
# Constructor names other chat models use for our fields (ChatOpenAI, ChatOllama, ChatAnthropic).
_ALIASES = {"model_name": "model", "max_completion_tokens": "max_tokens", "num_predict": "max_tokens",
            "stop_sequences": "stop"}
# Settings of remote clients that mean nothing to an in-process engine: warned about, then dropped.
_REMOTE_ONLY = frozenset({"timeout", "request_timeout", "max_retries", "api_key", "openai_api_key", "base_url",
                          "openai_api_base", "organization", "default_headers", "http_client", "keep_alive"})


class ChatKVCMAS(BaseChatModel):
    """Chat model on the embedded kvcmas engine, shared by every agent in the process.

    All instances naming the same ``model`` share one engine (see ``kvcmas_agents.registry``), so
    the agents of a LangGraph or AutoGen workflow batch together and share KV cache. The agent
    name the engine accounts a call to is, in order: ``llm.bind(agent=...)``, the ``agent`` field,
    the model's ``name``, the LangGraph node running it (inside a subgraph, the parent node that runs
    the subgraph, so ``create_react_agent(..., name="researcher")`` used as a node is "researcher"),
    else ``"default"``.

    Agents reuse each other's KV: a shared engine created here runs ``reuse="kvcmas"`` unless
    ``reuse`` says otherwise. ``reuse`` is a mode's name or a ``ReuseOptions`` (mode and KVCMAS knobs);
    set on the model or per call (``llm.bind(reuse=...)``), it overrides the engine's setting for this
    model's requests, a per-call one knob by knob.

    >>> llm = ChatKVCMAS(max_tokens=128)
    >>> await llm.ainvoke("Plan a CLI tool in three steps.")
    """

    model: str | None = None
    """Model to serve: None/"smollm2-135m-instruct", a checkpoint directory, or a .gguf file."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_tokens: int = 256
    """Most tokens to generate per call."""
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    """Stop strings; a per-call ``stop`` replaces these (as in ChatOpenAI)."""
    frequency_penalty: float | None = None
    """As ChatOpenAI's: in [-2, 2], times how often a token was generated so far, off its logit."""
    presence_penalty: float | None = None
    """As ChatOpenAI's: in [-2, 2], off the logit of every token generated so far."""
    logit_bias: dict[int, int] | None = None
    """As ChatOpenAI's: token id -> [-100, 100] added to its logit (at most 300)."""
    streaming: bool = False
    """Stream by default (``invoke`` then goes through ``_stream``)."""
    agent: str | None = None
    """Agent name for every call of this model (else ``name``, else the LangGraph node)."""
    reuse: str | ReuseOptions | None = None
    """KV reuse for this model's requests: a mode ("none", "prefix", "naive", "kvcmas", ...), or a
    ``ReuseOptions`` with the mode and KVCMAS knobs (``recompute_ratio``, ``rank``, ``reference``);
    None or an unset knob keeps the engine's. A shared engine this instance creates runs its mode, else
    "kvcmas"."""
    tool_call_threshold: float | None = DEFAULT_THRESHOLD
    """With bound tools and tool_choice "auto": the log probability of the reply opening with a tool
    call above which it is a (grammar-constrained) call, scored by a decision step first
    (docs/tool_calls.md). None leaves the choice to free decoding, where the default model never calls."""
    engine: Engine | None = Field(default=None, exclude=True, repr=False)
    """An explicit engine; overrides the shared registry engine."""

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, values: Any) -> Any:
        """Map other chat models' names for our fields; warn about remote-only settings; reject the rest."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        legacy = {k: values.pop(k) for k in LEGACY_KNOBS if k in values}
        if legacy:
            values["reuse"] = fold_legacy(values.get("reuse"), legacy, "ChatKVCMAS", stacklevel=5)
        for alias, field in _ALIASES.items():
            if alias in values:
                if field in values:
                    raise ValueError(f"ChatKVCMAS got both {field!r} and its alias {alias!r}; give one")
                values[field] = values.pop(alias)
        remote = sorted(k for k in values if k in _REMOTE_ONLY)
        if remote:
            warnings.warn(f"ChatKVCMAS runs the model in this process; {remote} has no effect and is ignored",
                          UserWarning, stacklevel=4)
        unknown = sorted(set(values) - set(cls.model_fields) - _REMOTE_ONLY - {"callback_manager"})
        if unknown:
            raise ValueError(f"ChatKVCMAS got unexpected arguments {unknown}; its fields are "
                             f"{sorted(cls.model_fields)} (see also {sorted(_ALIASES)})")
        return {k: v for k, v in values.items() if k not in _REMOTE_ONLY}

    @model_validator(mode="after")
    def _check_reuse_options(self) -> "ChatKVCMAS":
        to_options(self.reuse).validate()
        SamplingParams(frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                       logit_bias=self.logit_bias).validate()
        return self

    @property
    def recompute_ratio(self) -> float | None:
        """Deprecated: ``reuse.recompute_ratio``."""
        return self._legacy_knob("recompute_ratio")

    @property
    def rank(self) -> int | None:
        """Deprecated: ``reuse.rank``."""
        return self._legacy_knob("rank")

    @property
    def reference(self) -> str | None:
        """Deprecated: ``reuse.reference``."""
        return self._legacy_knob("reference")

    def _legacy_knob(self, name: str) -> Any:
        warnings.warn(f"ChatKVCMAS.{name} is deprecated; read reuse.{name} (reuse is a ReuseOptions when "
                      f"knobs are set)", DeprecationWarning, stacklevel=3)
        return getattr(to_options(self.reuse), name)

    # --- LangChain metadata ------------------------------------------------------------------
    @property
    def lc_attributes(self) -> dict[str, Any]:
        """A ``ReuseOptions`` serializes as its fields (``loads`` validates them back)."""
        return {"reuse": asdict(self.reuse)} if isinstance(self.reuse, ReuseOptions) else {}

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """True: ``dumpd``/``loads`` round-trip the settings (an explicit ``engine`` is not kept)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """``["kvcmas_agents", "integrations", "langchain"]``; pass ``valid_namespaces=["kvcmas_agents"]`` to ``loads``."""
        return ["kvcmas_agents", "integrations", "langchain"]

    @property
    def _llm_type(self) -> str:
        return "kvcmas"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model or DEFAULT_MODEL, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop, "agent": self.agent, **asdict(to_options(self.reuse)),
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "logit_bias": self.logit_bias, "tool_call_threshold": self.tool_call_threshold}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider=conv.PROVIDER, ls_model_name=kwargs.get("model") or self.model
                                 or DEFAULT_MODEL, ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # --- engine access -------------------------------------------------------------------------
    def get_engine(self, model: str | None = None) -> Engine:
        """The engine this model runs on (created on first use). ``model`` overrides the field."""
        if self.engine is not None and (model is None or model == self.model):
            return self.engine
        return get_engine(model if model is not None else self.model,
                          reuse=to_options(self.reuse).reuse or ADAPTER_REUSE)

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids for ``text`` (no special tokens), unless ``custom_get_token_ids`` is set."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self.get_engine().tokenize(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[Any] | None = None) -> int:
        """Exact prompt tokens, as rendered by the model's chat template."""
        specs = [convert_to_openai_tool(t) for t in tools] if tools else None
        return self.get_engine().count_tokens(conv.to_engine_messages(messages), specs)

    # --- generation ------------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        engine, request = self._request(messages, stop, run_manager, kwargs)
        out = engine.generate_sync(**request)
        return _result(conv.ai_message(out, engine.model_name))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        engine, request = self._request(messages, stop, run_manager, kwargs)
        out = await engine.generate(**request)
        return _result(conv.ai_message(out, engine.model_name))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        engine, request = self._request(messages, stop, run_manager, kwargs)
        for chunk in iterate_sync(lambda: _chunks(engine, request)):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        engine, request = self._request(messages, stop, run_manager, kwargs)
        async for chunk in _chunks(engine, request):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
                 kwargs: dict[str, Any]) -> tuple[Engine, dict[str, Any]]:
        """Resolve the engine and build ``Engine.generate`` arguments for one call."""
        kwargs = dict(kwargs)
        for key in _IGNORED_KEYS:
            kwargs.pop(key, None)
        engine = self.get_engine(kwargs.pop("model", None))
        agent = (kwargs.pop("agent", None) or self.agent or self.name or _langgraph_agent(run_manager)
                 or DEFAULT_AGENT)
        tools = kwargs.pop("tools", None) or None
        tool_choice = kwargs.pop("tool_choice", None)
        if tool_choice == "none":
            tools, tool_choice = None, None
        response_format = kwargs.pop("response_format", None)
        instruction = structured.format_instruction(response_format)
        sampling = self._sampling(stop, {k: kwargs.pop(k) for k in _SAMPLING_KEYS if k in kwargs})
        sampling.response_format = response_format      # decoding is constrained to it (engine grammar)
        reuse_options = self._reuse_options(kwargs.pop("reuse", None),
                                            {k: kwargs.pop(k) for k in LEGACY_KNOBS if k in kwargs})
        if kwargs:
            raise TypeError(f"ChatKVCMAS got unexpected call arguments: {sorted(kwargs)}")
        engine_messages = with_system_text(conv.to_engine_messages(messages), instruction)
        decision = None if self.tool_call_threshold is None else ToolDecision(self.tool_call_threshold)
        return engine, {"messages": engine_messages, "agent": agent, "sampling": sampling,
                        "tools": tools, "tool_choice": tool_choice, "reuse_options": reuse_options,
                        "tool_decision": decision}

    def _reuse_options(self, call: Any, legacy: dict[str, Any]) -> ReuseOptions:
        """One request's reuse knobs: the call's, then the model's; None leaves the engine's setting."""
        options = override(to_options(self.reuse), fold_legacy(call, legacy, "ChatKVCMAS call", stacklevel=5))
        options.validate()
        return options

    def _sampling(self, stop: list[str] | None, overrides: dict[str, Any]) -> SamplingParams:
        params = {k: getattr(self, k) for k in _SAMPLING_KEYS} | overrides
        return SamplingParams(
            max_tokens=params["max_tokens"], temperature=params["temperature"],
            top_p=1.0 if params["top_p"] is None else params["top_p"],
            top_k=0 if params["top_k"] is None else params["top_k"], seed=params["seed"],
            stop=list(self.stop or []) if stop is None else list(stop),
            frequency_penalty=params["frequency_penalty"] or 0.0, presence_penalty=params["presence_penalty"] or 0.0,
            logit_bias=dict(params["logit_bias"]) if params["logit_bias"] else None)

    # --- tools and structured output -----------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: dict[str, Any] | str | bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic classes or OpenAI tool dicts).

        ``tool_choice``: "auto", "none", "any"/"required"/True (must call some tool), a tool name,
        or ``{"type": "function", "function": {"name": ...}}``. A forcing choice constrains decoding
        to one well-formed call of that tool (of any bound tool for "any"), arguments valid against
        its schema.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _check_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type | None = None, *,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Return a runnable whose output follows ``schema``.

        method: "json_schema" (default: decoding is constrained to JSON valid against the schema,
        which the system prompt also shows), "function_calling" (decoding is constrained to one
        call of a tool made from the schema; LangChain's tool parsing), or "json_mode" (decoding
        is constrained to a JSON object; ``schema`` is only used to parse). ``strict`` is accepted
        for compatibility: output is always constrained. A reply cut by ``max_tokens`` is
        incomplete JSON and fails to parse.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"unknown method {method!r}; use 'function_calling', 'json_schema' or 'json_mode'")
        bound: dict[str, Any] = {"response_format": structured.response_format_for(schema, method)}
        if schema is not None:
            bound["ls_structured_output_format"] = {"kwargs": {"method": method}, "schema": schema}
        return structured.attach_parser(self.bind(**bound), structured.json_parser(schema), include_raw)


def _check_tool_choice(tool_choice: dict[str, Any] | str | bool, names: list[str]) -> dict[str, Any] | str:
    if tool_choice is True:
        return "any"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    elif tool_choice in ("auto", "none", "any", "required"):
        return tool_choice
    else:
        name = tool_choice
    if name not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound tools: {names}")
    return tool_choice


def _langgraph_agent(run_manager: Any) -> str | None:
    """The LangGraph agent running this call, from run metadata or the current runnable config.

    ``langgraph_checkpoint_ns`` is ``"node:task"`` segments joined by ``"|"``, outermost first, ending
    with the node that runs this call. Inside a subgraph its nodes are the steps of one agent, the
    parent node that runs the subgraph (the segment before the last).
    """
    metadata = getattr(run_manager, "metadata", None) or ensure_config().get("metadata") or {}
    namespace = metadata.get("langgraph_checkpoint_ns")
    if isinstance(namespace, str) and "|" in namespace:
        return namespace.split("|")[-2].partition(":")[0] or None
    node = metadata.get("langgraph_node")
    return node if isinstance(node, str) and node else None


async def _chunks(engine: Engine, request: dict[str, Any]) -> AsyncIterator[ChatGenerationChunk]:
    """Engine deltas as LangChain chunks; tool-call blocks are held back for the final chunk."""
    hide = ToolBlockFilter() if request["tools"] else None
    shown = ""
    async for delta in engine.stream(**request):
        text = hide.push(delta.text) if hide else delta.text
        if delta.output is not None:
            text += hide.flush() if hide else ""
            content = delta.output.content        # a call cut by max_tokens is content, as in invoke()
            if hide and content.startswith(shown + text):
                text = content[len(shown):]
            yield ChatGenerationChunk(message=conv.final_chunk(text, delta.output, engine.model_name),
                                      generation_info={"finish_reason": delta.output.finish_reason})
        elif text:
            shown += text
            yield ChatGenerationChunk(message=AIMessageChunk(content=text))


def _result(message: AIMessage) -> ChatResult:
    return ChatResult(generations=[ChatGeneration(
        message=message, generation_info={"finish_reason": message.response_metadata.get("finish_reason")})])
