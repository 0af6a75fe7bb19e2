"""Per-request state that the scheduler, the runner and the reuse methods share inside the worker (a
method keeps its own bookkeeping of a request itself: ``reuse.plan.RequestStates``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..chat.detokenize import IncrementalDetokenizer
from ..chat.template import RenderedPrompt
from ..model.grammar import GrammarState
from ..reuse.options import ReuseOptions
from ..timing import Timings
from .config import SamplingParams


@dataclass
class Request:
    """One chat request in the worker (it satisfies ``reuse.base.ReuseRequest``)."""

    request_id: str
    agent: str
    prompt: RenderedPrompt
    sampling: SamplingParams
    max_new_tokens: int                    # sampling.max_tokens clipped to the context window
    detok: IncrementalDetokenizer
    sink: Callable[[Any], None]            # receives StreamDelta events, or an exception
    generator: torch.Generator | None = None
    tool_names: set[str] | None = None
    grammar: GrammarState | None = None    # constrained decoding: its position in the output grammar
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)   # engine.logprobs.Logprob per sampled token
    logprobs_sent: int = 0                 # how many of them stream deltas carried
    blocks: list[int] = field(default_factory=list)
    reserved_blocks: int = 0               # blocks promised at admission, not yet allocated
    num_computed: int = 0                  # tokens whose KV is in the cache
    cached_tokens: int = 0                 # exact KV it did not compute (prefix cache, exact home views)
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    options: ReuseOptions = field(default_factory=ReuseOptions)   # resolved reuse knobs
    # Its reuse plan's layout (``reuse.plan.ReusePlan``, set by ``RequestBlocks.apply_plan``):
    own_prefix_end: int = 0                # own prefill [0, own_prefix_end), then the reused span, then own tail
    reuse_end: int = 0                     # first position after the reused span
    own_spans: tuple[tuple[int, int], ...] = ()   # inside the reused span: positions with own KV blocks
    finish_reason: str | None = None
    stop_reason: str | None = None
    aborted: bool = False
    exact_fallback: bool = False           # served as an exact prefill: its reuse did not fit or failed
    fallback: str | None = None            # why it fell back from reuse ("budget", or the failure)
    declare: bool = False                  # Engine.declare_agent's prefill of an agent's system prefix
    timings: Timings = field(default_factory=Timings)   # seconds by phase until the first token (timing.py)
    admitted_at: float | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt.token_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.token_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt.token_ids) + self.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt.token_ids)

    @property
    def needs_correction(self) -> bool:
        """Its own prefix is computed and the reused pieces are not yet usable."""
        return (self.reuse_end > self.num_computed >= self.own_prefix_end)

    def is_hole(self, start: int, end: int) -> bool:
        """True when positions [start, end) all lie in reused pieces (no own KV needed there)."""
        return (self.own_prefix_end <= start and end <= self.reuse_end
                and not any(a < end and start < b for a, b in self.own_spans))
