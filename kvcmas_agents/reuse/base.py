"""The seam between the engine and the reuse methods.

A reuse method decides which of a request's KV it need not compute and makes that KV usable. The
engine calls it at fixed points of a request's life, and knows nothing else about it:

    plan      at admission: the request's KV it need not compute (``ReusePlan``; the scheduler applies it)
    pending   whether ``prepare`` has real work for it (the engine runs one such per step)
    prepare   once its own prefix is computed: make the reused pieces usable (correct them)
    view      the attention view its steps read over [0, end), or None for plain paged KV
    on_computed / on_finish / release   after a step wrote its KV / when it ends / when it lets go
    admitting, idle, drop_idle_work     work off the critical path (ahead-of-time corrections)
    state_bytes, shed_state, stats      what it holds outside KV blocks (charged to the KV budget, dropped
                                        least recently used first when it needs room), and what it did

Methods are registered by name (``registry.register``); requests pick one with ``reuse=``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch

from ..cache.kv_store import KVStore
from ..cache.prefix_cache import PrefixCache
from ..chat.template import RenderedPrompt
from ..model.llama import LlamaModel
from .options import DEFAULT_RANK, DEFAULT_RECOMPUTE_RATIO, DEFAULT_REFERENCE, ReuseOptions
from .plan import EMPTY_PLAN, ReusePlan
from .realign import Realigner
from .segments import SegmentStore


class ReuseRequest(Protocol):
    """What a reuse method reads of a request (the engine's ``Request``). A method keeps whatever else it
    needs of a request in state of its own (``plan.RequestStates``); it writes only the usage counters
    that preparing changes (``reused_tokens``, ``recomputed_tokens``)."""

    request_id: str
    agent: str
    prompt: RenderedPrompt
    options: ReuseOptions
    arrival: float
    declare: bool
    blocks: list[int]                  # KV blocks by position (-1: wholly inside a reused span)
    num_computed: int
    max_new_tokens: int
    output_ids: list[int]
    reused_tokens: int                 # KV reused from other contexts, corrected or not
    recomputed_tokens: int
    timings: Any                       # seconds by phase (``timing.Timings``)

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def all_ids(self) -> list[int]: ...
    @property
    def in_prefill(self) -> bool: ...


@dataclass
class ReuseContext:
    """What the engine shares with every reuse method: the model, KV memory, the home views, and the
    few block services a method may call (side requests for work ahead of time, a decode copy's blocks);
    none of them calls a method back."""

    model: LlamaModel
    store: KVStore
    prefix: PrefixCache
    segments: SegmentStore
    realigner: Realigner
    view_path: str                                       # "gather", "query" or "triton" (resolved)
    predecessors: Callable[[str], list[str]]             # the edge order
    successors: Callable[[str], list[str]]
    side_request: Callable[..., ReuseRequest]            # (request_id, agent, prompt, options)
    apply: Callable[[ReuseRequest, ReusePlan], None]     # lay a side request's plan out (as admission does)
    reserve: Callable[[ReuseRequest, int], bool]         # promise and allocate a side request's blocks
    release: Callable[[ReuseRequest], None]              # free its blocks and promises (not the method's pins)
    own_holes: Callable[[ReuseRequest], bool] = lambda req: False   # own blocks for a running request's holes

    @property
    def device(self) -> torch.device:
        return self.model.device


class ReuseMethod:
    """Base of every reuse method: reuses nothing and holds nothing (the hooks do nothing)."""

    name: ClassVar[str]
    cross_agent: ClassVar[bool] = False      # reads other agents' home views (needs realignable RoPE)
    reuses: ClassVar[bool] = True            # reuses any KV at all (a declared prefix can help it)
    recomputes_reused: ClassVar[bool] = True  # its recomputed_tokens are among its reused_tokens
    config_class: ClassVar[type | None] = None   # its settings' type (None: it takes none)

    def __init__(self, ctx: ReuseContext, settings: Any = None):
        self.ctx = ctx
        self.settings = settings

    @classmethod
    def settings_of(cls, config: Any) -> Any:
        """This method's settings in an EngineConfig: its entry in ``config.methods``, else its
        ``config_class()`` defaults (None when it takes no settings)."""
        if cls.config_class is None:
            return None
        settings = (getattr(config, "methods", None) or {}).get(cls.name)
        return settings if settings is not None else cls.config_class()

    @classmethod
    def defaults(cls, config: Any) -> tuple[float, int, str]:
        """(recompute_ratio, rank, reference) a request of this mode gets when it sets none."""
        return DEFAULT_RECOMPUTE_RATIO, DEFAULT_RANK, DEFAULT_REFERENCE

    # --- a request's life -------------------------------------------------------------------
    def plan(self, req: ReuseRequest) -> ReusePlan:
        """At admission: the request's KV it need not compute, for the engine to apply. What it takes
        (pins, the plan's blocks) is undone by ``release``."""
        return EMPTY_PLAN

    def pending(self, req: ReuseRequest) -> bool:
        """Whether ``prepare`` has work to do for this request (not just bookkeeping)."""
        return False

    def prepare(self, req: ReuseRequest) -> None:
        """Make the plan's reused span [own_prefix_end, reuse_end) usable; the engine then counts it as computed."""

    def view(self, req: ReuseRequest, end: int) -> Any:
        """The attention view of the request's context [0, end), or None for its plain paged KV."""
        return None

    def on_computed(self, req: ReuseRequest) -> None:
        """A step has written KV for the request's tokens up to ``req.num_computed``."""

    def on_finish(self, req: ReuseRequest, reason: str) -> None:
        """The request ended ("stop", "length", "aborted" or "error"), before its KV is released."""

    def release(self, req: ReuseRequest) -> None:
        """Let go of what ``plan`` took (pins) and of the request's state, at the end or after a failed admission."""

    # --- work off the critical path ---------------------------------------------------------
    def admitting(self, agents: set[str]) -> None:
        """These agents' requests are about to be admitted: run work queued for them first."""

    def idle(self, busy: set[str]) -> bool:
        """Run one unit of queued work while nothing waits and nothing prefills (``busy``: the agents
        with running requests). Returns whether it had any queued, run or held back: False means the
        engine may sleep as far as this method is concerned."""
        return False

    def drop_idle_work(self) -> None:
        """Forget all queued work (it raised: the requests it was for do without it)."""

    # --- accounting ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes this method holds outside the KV blocks (corrections, anchors)."""
        return 0

    def shed_state(self) -> bool:
        """Drop the least recently used piece of that state (the KV budget needs room); False when none can go."""
        return False

    def stats(self) -> dict[str, Any]:
        return {}
