"""Segment store for cross-agent reuse: one exact home view per message segment, plus each agent's
low-rank corrections of the segments it reuses.

A home view is the KV of a segment's tokens in the context where it was first computed. It owns
references to the KV blocks holding it (no copy). Corrections are keyed by (agent, segment, start
position, context), so an agent never re-corrects a segment it already holds a correction for.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cache.home_pack import HomePacker
from ..cache.kv_store import KVStore
from .storage.delta import LowRankDelta, unique_nbytes


DECODE_KEY = 4          # tokens indexing decoded replies for the search inside segments
MIN_DECODED = 8         # shorter replies are not worth a home (and match by accident)


def context_key(agent: str, token_ids: list[int], end: int) -> int:
    """Identity of what precedes a segment: the agent (its view) and the tokens before it."""
    return hash((agent, tuple(token_ids[:end])))


@dataclass
class HomeView:
    key: tuple[int, ...]        # the segment's tokens
    agent: str                  # whose context computed it
    start: int                  # its first position there
    context: int                # context_key of that computation
    slots: torch.Tensor         # KV slots of its tokens, in order (partial edge blocks' tokens packed)
    blocks: list[int]           # blocks holding those slots (one reference each)
    users: int = 0              # running requests reading it (pinned while > 0)
    decoded: bool = False       # KV from the generating agent's decode, matched inside message segments
    own: bool = False           # read only by its agent, exactly, at the same place (``register_own``)
    born: float = field(default_factory=time.perf_counter)    # when it was registered


@dataclass
class Correction:
    """An agent's correction of one segment at one position: its reference chain plus its own delta."""

    agent: str
    start: int
    chain: list[LowRankDelta]   # reference chain first, this agent's own delta last
    own: LowRankDelta
    reference: str              # "home" or "chain:<predecessor>"
    recomputed: int
    users: int = 0              # requests reading it (never evicted while > 0)

    @property
    def nbytes(self) -> int:
        return self.own.nbytes


@dataclass
class SegmentStats:
    homes: int = 0
    home_tokens: int = 0
    corrections: int = 0
    correction_bytes: int = 0
    basis_bytes: int = 0        # the part of correction_bytes held by B factors
    evicted: int = 0
    by_agent: dict[str, int] = field(default_factory=dict)


class SegmentStore:
    def __init__(self, store: KVStore, is_cached: Callable[[int], bool] = lambda block: False):
        self.store = store
        # By tokens; an agent's own homes by ("own", agent, start, context, tokens) (``register_own``).
        self._homes: OrderedDict[tuple, HomeView] = OrderedDict()
        self._own_at: dict[tuple[str, int, int], list[HomeView]] = {}      # (agent, start, context) -> own homes
        # Least recently used first: corrections are dropped in that order when the KV budget needs room.
        self._corrections: OrderedDict[tuple[str, tuple[int, ...], int, int], Correction] = OrderedDict()
        self.corrections_evicted = 0
        self._bytes: int | None = None           # correction_bytes, cached until the corrections change
        self._decoded: dict[tuple[int, ...], list[HomeView]] = {}    # first DECODE_KEY tokens -> homes
        self.evicted = 0
        self.is_cached = is_cached               # prefix-cache membership (released blocks stay cached)
        self.packer = HomePacker(store)          # partial blocks' tokens are packed (cache/home_pack.py)

    def lookup(self, tokens: tuple[int, ...], before: float = float("inf")) -> HomeView | None:
        """The home view of these tokens, if one was registered before ``before`` (a request's arrival)."""
        home = self._homes.get(tokens)
        if home is None or home.born > before:
            return None
        self._homes.move_to_end(tokens)
        return home

    def register(self, tokens: tuple[int, ...], agent: str, start: int, context: int,
                 blocks: list[int]) -> HomeView | None:
        """Keep the KV at positions [start, start + len) of a sequence with these blocks as a home view."""
        if not tokens or tokens in self._homes:
            return None
        slots, held = self.packer.place(blocks, start, start + len(tokens))
        home = HomeView(tokens, agent, start, context, slots, held)
        self._homes[tokens] = home
        return home

    def register_own(self, tokens: tuple[int, ...], agent: str, start: int, context: int, blocks: list[int],
                     exact: list[tuple[int, int, HomeView]]) -> HomeView | None:
        """Keep KV an agent holds exactly, but from several places, as one home that only this agent reads,
        exactly, at the same place after the same context: a reply with the generation prompt it was
        decoded from, a message of a reused reply and its computed trailer. ``exact`` lists the spans
        [a, b) read from home views at delta 0 (their slots are shared); the rest is in ``blocks``
        (packed like any home's)."""
        key = ("own", agent, start, context, tokens)
        if not tokens or key in self._homes:
            return None
        slots, held, at = [], [], start
        for a, b, home in exact + [(start + len(tokens), start + len(tokens), None)]:
            if a > at:
                own, blks = self.packer.place(blocks, at, a)       # one reference taken per block listed
                slots.append(own)
                held += blks
            if home is not None:
                part = home.slots[a - home.start:b - home.start]
                slots.append(part)
                for x in (int(x) for x in (part // self.store.block_size).unique()):
                    self.store.incref(x)
                    held.append(x)
            at = b
        home = HomeView(tokens, agent, start, context, torch.cat(slots), held, own=True)
        self._homes[key] = home
        self._own_at.setdefault((agent, start, context), []).append(home)
        return home

    def lookup_own(self, tokens: tuple[int, ...], agent: str, start: int, context: int,
                   before: float = float("inf")) -> HomeView | None:
        """The agent's own home (``register_own``) at ``start`` after ``context`` that shares the longest
        leading run with ``tokens``: the whole home, or a slice of it (a home of its own, sharing its
        slots) when only a run of at least MIN_DECODED tokens agrees. KV depends only on the tokens
        before it, so that run is exact wherever the rest differs: a reply re-encoded from its text
        (a tool call's closing braces merge into other tokens than the model emitted) keeps all but
        its last few tokens."""
        best, run = None, 0
        for home in self._own_at.get((agent, start, context), ()):
            if home.born > before:
                continue
            n = _common_run(home.key, tokens)
            if n > run or (n == run and best is not None and len(home.key) < len(best.key)):
                best, run = home, n
        if best is None or run < min(len(best.key), MIN_DECODED):
            return None
        self._homes.move_to_end(("own", agent, start, context, best.key))
        if run < len(best.key):      # (a slice made since ``before``, by a request admitted meanwhile, is the same KV)
            part = tokens[:run]
            return self._homes.get(("own", agent, start, context, part)) \
                or self.register_own(part, agent, start, context, [], [(start, start + run, best)])
        return best

    def register_decoded(self, tokens: tuple[int, ...], agent: str, start: int, context: int,
                         blocks: list[int]) -> HomeView | None:
        """Keep a reply's decode KV as the home of its tokens, wherever they later appear in a message."""
        if len(tokens) < MIN_DECODED:
            return None
        home = self.register(tokens, agent, start, context, blocks)
        if home is not None:
            home.decoded = True
            self._decoded.setdefault(tokens[:DECODE_KEY], []).append(home)
        return home

    def find_decoded(self, tokens: tuple[int, ...], before: float = float("inf")) -> tuple[int, HomeView] | None:
        """The longest decoded reply that occurs whole inside ``tokens`` (a message segment, whose role
        header and trailer differ from the reply's), as (offset, home); only replies registered before
        ``before``."""
        best: tuple[int, HomeView] | None = None
        for i in range(len(tokens) - MIN_DECODED + 1):
            for home in self._decoded.get(tokens[i:i + DECODE_KEY], ()):
                n = len(home.key)
                if home.born <= before and tokens[i:i + n] == home.key and (best is None or n > len(best[1].key)):
                    best = (i, home)
        if best is not None:
            self._homes.move_to_end(best[1].key)
        return best

    def correction(self, agent: str, tokens: tuple[int, ...], start: int, context: int) -> Correction | None:
        key = (agent, tokens, start, context)
        corr = self._corrections.get(key)
        if corr is not None:
            self._corrections.move_to_end(key)
        return corr

    def add_correction(self, tokens: tuple[int, ...], context: int, corr: Correction) -> None:
        key = (corr.agent, tokens, corr.start, context)
        self._corrections[key] = corr
        self._corrections.move_to_end(key)
        self._bytes = None

    def evict_correction(self) -> bool:
        """Drop the least recently used correction no request reads; False when none can go. (A request
        keeps its own reference to what it reads, so dropping that would free nothing.)"""
        for key, corr in self._corrections.items():
            if corr.users == 0:
                del self._corrections[key]
                self._bytes = None
                self.corrections_evicted += 1
                return True
        return False

    def held_corrections(self) -> dict[tuple[str, tuple[int, ...], int, int], Correction]:
        """Every correction held, by (agent, segment tokens, start, context): a copy, for reports."""
        return dict(self._corrections)

    def corrections_of(self, agent: str, tokens: tuple[int, ...]) -> list[Correction]:
        return [c for (a, t, _, _), c in self._corrections.items() if a == agent and t == tokens]

    def pin(self, home: HomeView) -> None:
        home.users += 1

    def unpin(self, home: HomeView) -> None:
        home.users -= 1

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned home view (and its corrections) to free blocks."""
        for key, home in self._homes.items():
            if home.users == 0:
                del self._homes[key]
                if home.decoded:
                    _unindex(self._decoded, key[:DECODE_KEY], home)
                if home.own:
                    _unindex(self._own_at, (home.agent, home.start, home.context), home)
                for b in home.blocks:
                    self.store.decref(b, cached=self.is_cached(b))
                    self.packer.released(b)
                for ck in [] if home.own else [ck for ck in self._corrections if ck[1] == key]:
                    del self._corrections[ck]      # (own homes have none: they are read exactly)
                    self._bytes = None
                self.evicted += 1
                return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass

    def _held(self) -> list[LowRankDelta]:
        # Chains hold their predecessors' states (moved by a shift, sharing tensors), and keep them alive
        # after those corrections are evicted; unique_nbytes counts each tensor once. A snapshot: stats()
        # reads it from other threads while the worker reorders the LRU.
        return [d for c in list(self._corrections.values()) for d in c.chain]

    def stats(self) -> SegmentStats:
        s = SegmentStats(homes=len(self._homes), home_tokens=sum(len(h.key) for h in list(self._homes.values())),
                         corrections=len(self._corrections), correction_bytes=self.correction_bytes,
                         basis_bytes=unique_nbytes(self._held(), bases_only=True), evicted=self.evicted)
        held = list(self._corrections.values())
        for agent in {c.agent for c in held}:
            s.by_agent[agent] = unique_nbytes(c.own for c in held if c.agent == agent)
        return s

    @property
    def correction_bytes(self) -> int:
        """Bytes of all correction states held (own and chained); a tensor shared by several corrections
        (a joint basis, a predecessor's state in a chain) counts once. The worker reads it every step."""
        if self._bytes is None:
            self._bytes = unique_nbytes(self._held())
        return self._bytes

    @property
    def home_blocks(self) -> set[int]:
        return {b for h in self._homes.values() for b in h.blocks}


def _common_run(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _unindex(index: dict, key: tuple, home: HomeView) -> None:
    index[key].remove(home)
    if not index[key]:
        del index[key]
