"""The exact modes: "none" prefills every prompt; "prefix" reuses each agent's own earlier prefix,
block by block, as non-shared serving (vLLM, SGLang) does."""
from __future__ import annotations

from .base import ReuseMethod, ReuseRequest
from .registry import register


@register
class NoReuse(ReuseMethod):
    """Every request prefills its whole prompt."""

    name = "none"
    reuses = False


@register
class PrefixReuse(ReuseMethod):
    """Per-agent exact prefix caching: full KV blocks indexed by a chained hash of (agent, tokens)."""

    name = "prefix"

    def plan(self, req: ReuseRequest) -> None:
        store = self.ctx.store
        # Leave at least one prompt token to run, so the step produces logits.
        blocks, parent = self.ctx.prefix.match(req.agent, req.prompt_ids, len(req.prompt_ids) - 1)
        req.blocks = blocks
        req.num_computed = req.cached_tokens = len(blocks) * store.block_size
        req.indexed_blocks, req.index_parent = len(blocks), parent

    def on_computed(self, req: ReuseRequest) -> None:
        """Index the request's newly full blocks, so its agent's next prompt finds them."""
        if not req.prompt.prefix_stable:
            return
        full = req.num_computed // self.ctx.store.block_size
        if full > req.indexed_blocks:
            req.index_parent = self.ctx.prefix.insert(req.agent, req.all_ids, req.blocks,
                                                      req.indexed_blocks, full, req.index_parent)
            req.indexed_blocks = full
