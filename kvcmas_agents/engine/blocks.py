"""Requests' KV blocks against the store's promises: a request's plan laid out (``apply_plan``), blocks
promised at admission and allocated as its steps need them, holes where it reads reused KV instead,
and what it holds freed at its end. Knows no reuse method, so the methods can be built over it before
the scheduler that runs them (``ReuseContext``'s block services are these)."""
from __future__ import annotations

from ..cache.kv_store import KVStore
from ..cache.prefix_cache import PrefixCache
from ..reuse.plan import ReusePlan
from .request import Request


class RequestBlocks:
    def __init__(self, store: KVStore, prefix: PrefixCache):
        self.store = store
        self.prefix = prefix

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.store.block_size)

    @property
    def promised(self) -> int:
        """Blocks promised to running requests and not yet allocated."""
        return self.store.promised

    @property
    def room(self) -> int:
        """Blocks free or evictable that no running request was promised."""
        return self.store.room

    def apply_plan(self, req: Request, plan: ReusePlan) -> None:
        """Lay a plan out on a request with nothing computed yet: the plan's blocks are its first ones,
        computed already; its layout says which positions it computes and which it reads from others."""
        req.blocks = list(plan.blocks)
        req.num_computed = len(plan.blocks) * self.store.block_size
        req.cached_tokens, req.reused_tokens = plan.cached_tokens, plan.reused_tokens
        req.own_prefix_end, req.reuse_end, req.own_spans = plan.own_prefix_end, plan.reuse_end, plan.own_spans

    def own_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks a request must own to hold num_tokens (reused spans need none)."""
        bs = self.store.block_size
        return sum(1 for i in range(self.blocks_for(num_tokens)) if not req.is_hole(i * bs, (i + 1) * bs))

    def promise(self, req: Request, n: int) -> None:
        """Promise a request ``n`` more blocks, to allocate as it needs them (``ensure``)."""
        req.reserved_blocks += n
        self.store.promised += n

    def ensure(self, req: Request, num_tokens: int) -> None:
        """Allocate the request's blocks (from its promise) up to num_tokens; holes get none (-1)."""
        bs = self.store.block_size
        while len(req.blocks) < self.blocks_for(num_tokens):
            i = len(req.blocks)
            if req.is_hole(i * bs, (i + 1) * bs):
                req.blocks.append(-1)          # wholly inside a reused span: no own KV there
                continue
            req.blocks.append(self.store.allocate())
            req.reserved_blocks -= 1
            self.store.promised -= 1

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Promise and allocate the blocks a planned request owns for num_tokens (a side request); False
        (nothing taken) when they do not fit next to what running requests were promised."""
        need = self.own_blocks(req, num_tokens) - len(req.blocks)
        if need > self.room:
            return False
        self.promise(req, need)
        self.ensure(req, num_tokens)
        return True

    def own_holes(self, req: Request) -> bool:
        """Blocks of its own for a running request's holes (positions it reads from other contexts),
        beyond what it was promised, when they fit next to every promise (evicting unreferenced cached
        blocks if need be); all of [0, reuse_end) is then its own prefix. False: nothing changed."""
        holes = [i for i, b in enumerate(req.blocks) if b < 0]
        if len(holes) > self.room:
            return False
        for i, b in zip(holes, [self.store.allocate() for _ in holes]):
            req.blocks[i] = b
        req.own_prefix_end, req.own_spans = req.reuse_end, ()
        return True

    def free(self, req: Request) -> None:
        """Free a request's blocks and promises; its cached blocks stay indexed."""
        for b in req.blocks:
            if b >= 0:
                self.store.decref(b, cached=self.prefix.is_cached(b))
        req.blocks = []
        self.store.promised -= req.reserved_blocks
        req.reserved_blocks = 0
