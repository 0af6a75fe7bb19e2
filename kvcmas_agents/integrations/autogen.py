"""AutoGen model client on the shared embedded engine.

    from kvcmas_agents.integrations.autogen import KVCMASClient, register_team

    client = KVCMASClient(max_tokens=128)       # every client naming the same model shares one engine
    team = RoundRobinGroupChat([AssistantAgent("planner", client), AssistantAgent("coder", client)], ...)
    register_team(team)                          # tell the engine the speaking order

Each request is attributed to the AgentChat agent that made it (in a team or run alone), so
``engine.stats()["agents"]`` reports per-agent usage without any per-agent configuration. The shared
engine runs ``reuse="kvcmas"`` by default, so agents reuse the KV of messages other agents prefilled.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Literal, Mapping, Optional, Sequence, Union

from autogen_core import CancellationToken, Component
from autogen_core.models import (
    ChatCompletionClient, CreateResult, LLMMessage, ModelCapabilities, ModelFamily, ModelInfo, RequestUsage,
    validate_model_info,
)
from autogen_core.tools import Tool, ToolSchema
from pydantic import BaseModel
from typing_extensions import Self

from ..chat.template import with_system_text
from ..engine import Engine, EngineError, RequestOutput, ReuseOptions, SamplingParams, ToolDecision
from ..engine.tool_decision import DEFAULT_THRESHOLD
from ..registry import ADAPTER_REUSE, get_engine, hold_engine, release_engine
from ._autogen_convert import (
    json_instruction, response_format, to_create_result, to_engine_messages, to_engine_tool_choice, to_engine_tools,
)
from ..chat.tool_filter import ToolBlockFilter
from ._reuse import LEGACY_KNOBS, ReuseSetting, compact, fold_legacy, override, to_options
from ._autogen_team import calling_agent_name, current_agent_name, team_edges

__all__ = ["KVCMASClient", "KVCMASClientConfig", "register_team"]

_SAMPLING_ARGS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "stop", "frequency_penalty",
                  "presence_penalty", "logit_bias")
_DONE = object()


class KVCMASClientConfig(BaseModel):
    """Declarative config of a KVCMASClient (the engine instance itself is not serialized)."""

    model: Optional[str] = None
    temperature: float = 0.0
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    agent: Optional[str] = None
    reuse: Union[str, ReuseOptions, None] = None
    # Deprecated: configs saved before ``reuse`` took a ReuseOptions; folded into it on load.
    recompute_ratio: Optional[float] = None
    rank: Optional[int] = None
    reference: Optional[str] = None
    tool_call_threshold: Optional[float] = DEFAULT_THRESHOLD
    model_info: Optional[ModelInfo] = None


@dataclass
class _Prepared:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | None
    sampling: SamplingParams
    agent: str
    reuse_options: ReuseOptions


class KVCMASClient(ChatCompletionClient, Component[KVCMASClientConfig]):
    """An AutoGen ``ChatCompletionClient`` served by the process-wide kvcmas engine.

    Args:
        model: None or "smollm2-135m-instruct" for the default model, a checkpoint directory or a
            ``.gguf`` path. Clients naming the same model share one engine (``registry.get_engine``).
        temperature, max_tokens, top_p, top_k, seed, stop, frequency_penalty, presence_penalty, logit_bias:
            default sampling, with OpenAI's meaning and ranges; ``extra_create_args`` may override them per call.
        agent: the agent name to report when no AgentChat agent is calling (a calling agent's name wins,
            in a team or alone, then the running message handler's agent; ``extra_create_args={"agent": ...}``
            beats all).
        reuse: KV reuse for this client's requests: a mode ("none", "prefix", "naive", "kvcmas", ...) or a
            ``ReuseOptions`` with the mode and KVCMAS knobs (``recompute_ratio``, ``rank``, ``reference``);
            None or an unset knob keeps the engine's. A shared engine this client creates runs its mode or,
            if None, "kvcmas". ``extra_create_args={"reuse": ...}`` overrides it per call, knob by knob.
        recompute_ratio, rank, reference: deprecated, give them in ``reuse=ReuseOptions(...)``.
        tool_call_threshold: with tools and tool_choice "auto", a decision step scores the log probability
            of the reply opening with a tool call; above this it is a (grammar-constrained) call
            (docs/tool_calls.md). None leaves the choice to free decoding, where the default model never calls.
        engine: use this engine instead of the shared one.
        model_info: override the reported ModelInfo.
    """

    component_type = "model"
    component_config_schema = KVCMASClientConfig
    component_provider_override = "kvcmas_agents.integrations.autogen.KVCMASClient"

    def __init__(self, model: str | None = None, *, temperature: float = 0.0, max_tokens: int = 256,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: Mapping[int | str, float] | None = None,
                 agent: str | None = None, reuse: ReuseSetting = None, recompute_ratio: float | None = None,
                 rank: int | None = None, reference: str | None = None,
                 tool_call_threshold: float | None = DEFAULT_THRESHOLD, engine: Engine | None = None,
                 model_info: ModelInfo | None = None) -> None:
        self._defaults = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=seed, stop=list(stop or []),
                                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                        logit_bias=dict(logit_bias) if logit_bias is not None else None)
        self._defaults.validate()
        if agent is not None and (not isinstance(agent, str) or not agent):
            raise ValueError("agent must be a non-empty string")
        self._model = model if model is not None or engine is None else engine.config.model
        self._agent = agent
        legacy = {"recompute_ratio": recompute_ratio, "rank": rank, "reference": reference}
        self._reuse = to_options(fold_legacy(reuse, legacy, "KVCMASClient"))
        self._reuse.validate()
        self._decision = None if tool_call_threshold is None else ToolDecision(tool_call_threshold)
        self._engine = engine
        self._held = False              # True once it holds the shared engine (released by close)
        self._closed = False
        self._model_info: ModelInfo = model_info or {
            # json_output and structured output are enforced while decoding (grammar-constrained).
            "vision": False, "function_calling": True, "json_output": True,
            "structured_output": True, "family": ModelFamily.UNKNOWN,
        }
        validate_model_info(self._model_info)
        self._total_usage = RequestUsage(prompt_tokens=0, completion_tokens=0)
        self.last_output: RequestOutput | None = None
        """The engine's output for the latest finished request (KV reuse counters, timings)."""

    # --- engine -------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine serving this client (the shared one is created on first use)."""
        if self._closed:
            raise RuntimeError("KVCMASClient is closed")
        if self._engine is None:
            self._engine = hold_engine(self._model, reuse=self._reuse.reuse or ADAPTER_REUSE)
            self._held = True
        return self._engine

    # --- requests -----------------------------------------------------------------------------
    async def create(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: Optional[bool | type[BaseModel]] = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: Optional[CancellationToken] = None,
    ) -> CreateResult:
        """Run one request to completion; cancelling the token aborts it in the engine."""
        req = self._prepare(messages, tools, tool_choice, json_output, extra_create_args)
        task = asyncio.ensure_future(self.engine.generate(
            req.messages, agent=req.agent, sampling=req.sampling, tools=req.tools, tool_choice=req.tool_choice,
            reuse_options=req.reuse_options, tool_decision=self._decision))
        if cancellation_token is not None:
            cancellation_token.link_future(task)
        out = await task
        return self._finish(out, json_output)

    async def create_stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: Optional[bool | type[BaseModel]] = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: Optional[CancellationToken] = None,
    ) -> AsyncGenerator[Union[str, CreateResult], None]:
        """Yield text chunks, then exactly one CreateResult.

        Tool-call blocks are not streamed as text; they arrive as FunctionCalls in the result.
        """
        req = self._prepare(messages, tools, tool_choice, json_output, extra_create_args)
        queue: asyncio.Queue[Any] = asyncio.Queue()

        # One pump task per request, so that a single link to the token can abort the whole stream.
        async def pump() -> None:
            async for delta in self.engine.stream(req.messages, agent=req.agent, sampling=req.sampling,
                                                  tools=req.tools, tool_choice=req.tool_choice,
                                                  reuse_options=req.reuse_options,
                                                  tool_decision=self._decision):
                queue.put_nowait(delta)

        task = asyncio.ensure_future(pump())
        task.add_done_callback(lambda _: queue.put_nowait(_DONE))
        if cancellation_token is not None:
            cancellation_token.link_future(task)
        hold = ToolBlockFilter() if req.tools else None
        shown = ""
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    if task.cancelled():
                        raise asyncio.CancelledError()
                    raise task.exception() or EngineError("stream ended without an output")
                chunk = hold.push(item.text) if hold else item.text
                result = None if item.output is None else self._finish(item.output, json_output)
                if result is not None and hold:
                    # A block that was no call (cut off, bad JSON) is text in the result, as in create();
                    # the chunks then show what the filter held back, so they add up to that text.
                    rest = chunk + hold.flush()
                    text = result.content if isinstance(result.content, str) else ""
                    chunk = text[len(shown):] if text.startswith(shown + rest) else rest
                if chunk:
                    shown += chunk
                    yield chunk
                if result is not None:
                    yield result
                    return
        finally:
            if not task.done():
                task.cancel()

    def _prepare(self, messages: Sequence[LLMMessage], tools: Sequence[Tool | ToolSchema],
                 tool_choice: Tool | str, json_output: bool | type[BaseModel] | None,
                 extra: Mapping[str, Any]) -> _Prepared:
        unknown = set(extra) - {*_SAMPLING_ARGS, "reuse", *LEGACY_KNOBS, "agent"}
        if unknown:
            raise ValueError(f"unsupported extra_create_args {sorted(unknown)}; "
                             f"supported: {', '.join((*_SAMPLING_ARGS, 'reuse', 'agent'))}")
        if json_output is not None and not isinstance(json_output, bool) and not (
                isinstance(json_output, type) and issubclass(json_output, BaseModel)):
            raise ValueError("json_output must be None, a bool, or a pydantic BaseModel subclass")
        sampling = SamplingParams(**{k: extra.get(k, getattr(self._defaults, k)) for k in _SAMPLING_ARGS},
                                  response_format=response_format(json_output))
        sampling.validate()
        legacy = {k: extra[k] for k in LEGACY_KNOBS if k in extra}
        reuse_options = override(self._reuse, fold_legacy(extra.get("reuse"), legacy, "extra_create_args"))
        reuse_options.validate()
        engine_tools = to_engine_tools(tools)
        choice = to_engine_tool_choice(tool_choice, engine_tools)
        if choice == "none":   # the model cannot call what it is not shown
            engine_tools, choice = [], "auto"
        msgs = with_system_text(to_engine_messages(messages), json_instruction(json_output))
        agent = extra.get("agent") or calling_agent_name() or current_agent_name() or self._agent or "default"
        return _Prepared(msgs, engine_tools or None, choice if engine_tools else None, sampling, agent,
                         reuse_options)

    def _finish(self, out: RequestOutput, json_output: bool | type[BaseModel] | None) -> CreateResult:
        result = to_create_result(out, json_output)
        self.last_output = out
        self._total_usage = RequestUsage(
            prompt_tokens=self._total_usage.prompt_tokens + result.usage.prompt_tokens,
            completion_tokens=self._total_usage.completion_tokens + result.usage.completion_tokens)
        return result

    # --- accounting and info --------------------------------------------------------------------
    def actual_usage(self) -> RequestUsage:
        """Tokens this client actually ran (there is no response cache, so equal to ``total_usage``)."""
        return RequestUsage(self._total_usage.prompt_tokens, self._total_usage.completion_tokens)

    def total_usage(self) -> RequestUsage:
        """Tokens over all requests made through this client."""
        return RequestUsage(self._total_usage.prompt_tokens, self._total_usage.completion_tokens)

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        """Prompt tokens ``messages`` (and ``tools``) render to."""
        return self.engine.count_tokens(to_engine_messages(messages), to_engine_tools(tools) or None)

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        """Context tokens left after the prompt."""
        return max(0, self.engine.max_context - self.count_tokens(messages, tools=tools))

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def capabilities(self) -> ModelCapabilities:  # type: ignore[override]  # deprecated in AutoGen
        return {"vision": self._model_info["vision"], "function_calling": self._model_info["function_calling"],
                "json_output": self._model_info["json_output"]}

    async def close(self) -> None:
        """Release this client's hold on the shared engine; the engine closes when its last user does.

        An engine passed as ``engine=`` is the caller's and stays open. The client cannot be used after.
        """
        if self._closed:
            return
        self._closed = True
        if self._held:
            await asyncio.get_running_loop().run_in_executor(None, release_engine, self._engine)
        self._engine = None

    # --- component config -----------------------------------------------------------------------
    def _to_config(self) -> KVCMASClientConfig:
        d = self._defaults
        return KVCMASClientConfig(model=self._model, temperature=d.temperature, max_tokens=d.max_tokens,
                                  top_p=d.top_p, top_k=d.top_k, seed=d.seed, stop=list(d.stop) or None,
                                  frequency_penalty=d.frequency_penalty, presence_penalty=d.presence_penalty,
                                  logit_bias=d.logit_bias,
                                  agent=self._agent, reuse=compact(self._reuse),
                                  tool_call_threshold=self._decision.threshold if self._decision else None,
                                  model_info=self._model_info)

    @classmethod
    def _from_config(cls, config: KVCMASClientConfig) -> Self:
        args = config.model_dump(exclude={"reuse", *LEGACY_KNOBS})
        legacy = {k: getattr(config, k) for k in LEGACY_KNOBS}
        return cls(**args, reuse=fold_legacy(config.reuse, legacy, "KVCMASClientConfig"))


def team_engine(team: Any) -> Engine | None:
    """The engine behind the first participant that uses a KVCMASClient, if any."""
    for participant in getattr(team, "_participants", []):
        client = getattr(participant, "_model_client", None)
        if isinstance(client, KVCMASClient):
            return client.engine
    return None


def team_declarations(team: Any, engine: Engine) -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """(name, system messages, tools) of the participants that call ``engine`` with a system message.

    The tools are those an ``AssistantAgent`` shows the model on every call (its own tools, then its
    hand-off tools), as engine tool dicts.
    """
    out = []
    for participant in getattr(team, "_participants", []):
        client = getattr(participant, "_model_client", None)
        systems = getattr(participant, "_system_messages", None)
        if not isinstance(client, KVCMASClient) or client.engine is not engine or not systems:
            continue
        tools = list(getattr(participant, "_tools", [])) + list(getattr(participant, "_handoff_tools", []))
        out.append((participant.name, to_engine_messages(systems), to_engine_tools(tools)))
    return out


def register_team(team: Any, model_or_engine: str | Engine | None = None) -> list[tuple[str, str]]:
    """Register an AgentChat team's speaking order as the engine's edges and return them.

    RoundRobinGroupChat gives the cycle a→b→c→a; GraphFlow its DiGraph edges; SelectorGroupChat
    (and other group chats) the participant-order cycle, an approximation since the speaker is
    chosen at run time. The engine is ``model_or_engine`` if given, else the one behind the first
    participant using a KVCMASClient, else the shared default engine (created with reuse="kvcmas").

    Each participant that calls this engine through a KVCMASClient with a system message is also
    declared to it (``Engine.declare_agent``, with the tools it shows the model): its system prompt
    is prefilled now, and its predecessors correct the shared history for it ahead of time from its
    first turn on.
    """
    edges = team_edges(team)
    if isinstance(model_or_engine, Engine):
        engine = model_or_engine
    elif model_or_engine is not None:
        engine = get_engine(model_or_engine, reuse=ADAPTER_REUSE)
    else:
        engine = team_engine(team) or get_engine(None, reuse=ADAPTER_REUSE)
    engine.set_edges(edges)
    for name, system, tools in team_declarations(team, engine):
        engine.declare_agent(name, system, tools or None)
    return edges
