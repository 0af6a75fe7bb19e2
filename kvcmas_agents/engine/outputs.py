"""What the engine hands back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..chat.tools import InvalidToolCall, ToolCall
from .logprobs import Logprob


@dataclass
class Usage:
    """Token accounting for one request.

    cached_tokens: prompt tokens whose KV came exactly from the prefix cache.
    reused_tokens: prompt tokens whose KV was reused from another agent's view (cross-agent modes;
        with kvcomm only the segments served from anchors).
    recomputed_tokens: reused tokens that were recomputed to correct them (kvcmas, cacheblend); with
        kvcomm, the tokens of segments prefilled densely because no anchor matched (not in reused_tokens).
    kept_tokens: prompt tokens whose stored KV served the request as is: cached tokens plus the reused
        tokens that were not recomputed.
    exact_fallback: the request was served as an exact prefill instead of by its reuse mode (its reuse
        did not fit the KV budget, or failed: ``RequestOutput.fallback`` says why).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    kept_tokens: int = 0
    exact_fallback: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through a full forward pass in this request."""
        return self.prompt_tokens - self.cached_tokens - self.reused_tokens


@dataclass
class RequestOutput:
    """A finished request. ``text`` is the raw completion; ``content`` has tool-call blocks removed."""

    request_id: str
    agent: str
    text: str
    token_ids: list[int]
    finish_reason: str                    # "stop" | "length" | "tool_calls"
    ttft_s: float
    latency_s: float
    usage: Usage
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    stop_reason: str | None = None        # the stop string or token text that ended the request
    reuse: str = "none"                   # reuse mode that actually served this request
    prefix_stable: bool = True            # False when the template forced a plain prefill
    fallback: str | None = None           # why reuse gave way to an exact prefill ("budget", or the failure)
    logits: list[Any] | None = None       # per generated token fp32 logits, when asked for
    logprobs: list[Logprob] | None = None  # per generated token, when sampling.logprobs (engine/logprobs.py)
    # Where the time to first token went, in seconds by phase: queue (waiting for admission), plan,
    # ahead (queued ahead-of-time work run before admission), correct (of which select, recompute,
    # compress), forward (engine steps carrying the request); the rest of ttft_s is waiting on others.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamDelta:
    """One streamed step: new text and tokens; the last delta carries finish_reason and the output."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    logprobs: list[Logprob] | None = None  # this delta's tokens' logprobs, when sampling.logprobs
