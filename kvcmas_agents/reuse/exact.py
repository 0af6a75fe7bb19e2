"""The exact modes: "none" prefills every prompt; "prefix" reuses each agent's own earlier prefix,
block by block, as non-shared serving (vLLM, SGLang) does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ReuseMethod, ReuseRequest
from .plan import ReusePlan, RequestStates
from .registry import register


@register
class NoReuse(ReuseMethod):
    """Every request prefills its whole prompt."""

    name = "none"
    reuses = False


@dataclass
class Indexed:
    """How far a request's blocks are in the prefix index: its leading ``blocks``, and the chained hash
    after them (to resume indexing from)."""

    blocks: int = 0
    parent: int = 0


@register
class PrefixReuse(ReuseMethod):
    """Per-agent exact prefix caching: full KV blocks indexed by a chained hash of (agent, tokens)."""

    name = "prefix"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.indexed: RequestStates[Indexed] = RequestStates(Indexed)

    def plan(self, req: ReuseRequest) -> ReusePlan:
        # Leave at least one prompt token to run, so the step produces logits.
        blocks, parent = self.ctx.prefix.match(req.agent, req.prompt_ids, len(req.prompt_ids) - 1)
        self.indexed.set(req, Indexed(len(blocks), parent))
        return ReusePlan(cached_tokens=len(blocks) * self.ctx.store.block_size, blocks=tuple(blocks))

    def on_computed(self, req: ReuseRequest) -> None:
        """Index the request's newly full blocks, so its agent's next prompt finds them."""
        if not req.prompt.prefix_stable:
            return
        full = req.num_computed // self.ctx.store.block_size
        ix = self.indexed(req)
        if full > ix.blocks:
            ix.parent = self.ctx.prefix.insert(req.agent, req.all_ids, req.blocks, ix.blocks, full, ix.parent)
            ix.blocks = full

    def release(self, req: ReuseRequest) -> None:
        self.indexed.pop(req)
