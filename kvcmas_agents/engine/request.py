"""Per-request state that the scheduler and runner share inside the worker."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .chat import RenderedPrompt
from .config import SamplingParams
from .detokenize import IncrementalDetokenizer


@dataclass
class Request:
    request_id: str
    agent: str
    prompt: RenderedPrompt
    sampling: SamplingParams
    max_new_tokens: int                    # sampling.max_tokens clipped to the context window
    detok: IncrementalDetokenizer
    sink: Callable[[Any], None]            # receives StreamDelta events, or an exception
    generator: torch.Generator | None = None
    tool_names: set[str] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    reserved_blocks: int = 0               # blocks promised at admission, not yet allocated
    num_computed: int = 0                  # tokens whose KV is in the cache
    cached_tokens: int = 0                 # prompt tokens served by the prefix cache
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    indexed_blocks: int = 0                # leading blocks already in the prefix index
    index_parent: int = 0                  # chained hash after the indexed blocks
    finish_reason: str | None = None
    stop_reason: str | None = None
    aborted: bool = False

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
