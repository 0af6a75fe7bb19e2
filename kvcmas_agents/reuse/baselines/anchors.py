"""KVCOMM's anchor pool: measured KV offsets of shared text, per (agent, placeholder).

A placeholder is the slot of an agent's prompt that shared text fills. Here it is the chat message
index of the segment in the agent's prompt (0 = the system message, 1 = the first history message, ...),
i.e. the same slot of the same agent's template across conversations and turns.

An anchor keeps, for one segment measured once:
  base - the segment's home keys at one layer (SIM_LAYER), in the position-0 frame (token t at
         position t), [n, KVH, D]: what similarity is measured on;
  dk, dv - the FULL offsets at every layer, [L, n, KVH, D] each: the agent's exact KV of the segment
         under its own context minus the realigned home KV (dk in the position-0 frame).

Similarity of a new segment's base keys b [n', ...] to an anchor's a [n, ...]: the relative per-token
distance ``||b_t - a_t|| / ||b_t||`` averaged over the new segment's tokens, where tokens past the
anchor's length count 1 (fully different). Anchors within ``threshold`` are interpolated with weights
softmax(-distance / TEMPERATURE); offsets are aligned by token index, truncated or zero-padded to n'.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

TEMPERATURE = 0.02   # distances are relative, ~0 for the same text and ~1 for unrelated text


def sim_layer(num_layers: int) -> int:
    """The layer whose keys represent a segment for matching (the middle: token and context features)."""
    return num_layers // 2


@dataclass
class Anchor:
    agent: str
    placeholder: int
    base: torch.Tensor    # [n, KVH, D]
    dk: torch.Tensor      # [L, n, KVH, D]
    dv: torch.Tensor      # [L, n, KVH, D]
    uses: int = 0

    @property
    def length(self) -> int:
        return self.base.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.base, self.dk, self.dv))


@dataclass
class Match:
    anchors: list[Anchor]
    weights: torch.Tensor     # [A], sums to 1
    distance: float           # of the nearest anchor


@dataclass
class AnchorStats:
    anchors: int = 0
    anchor_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evicted: int = 0
    by_agent: dict[str, int] = field(default_factory=dict)


def distance(base: torch.Tensor, anchor: torch.Tensor) -> float:
    """Relative per-token key distance of base [n, ...] to anchor [m, ...] (see the module docstring)."""
    n, m = base.shape[0], min(base.shape[0], anchor.shape[0])
    if n == 0:
        return 0.0
    b, a = base[:m].float().flatten(1), anchor[:m].float().flatten(1)
    rel = (b - a).norm(dim=1) / b.norm(dim=1).clamp_min(1e-6)
    return float((rel.sum() + (n - m)) / n)


def fit(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [L, m, ...] truncated or zero-padded along dim 1 to n tokens."""
    if x.shape[1] >= n:
        return x[:, :n]
    pad = x.new_zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


class AnchorPool:
    def __init__(self, max_per_placeholder: int = 20, threshold: float = 0.25):
        self.max_per_placeholder, self.threshold = max_per_placeholder, threshold
        self._pools: dict[tuple[str, int], deque[Anchor]] = {}
        self.hits = self.misses = self.evicted = 0

    def match(self, agent: str, placeholder: int, base: torch.Tensor) -> Match | None:
        """Anchors of (agent, placeholder) within the threshold, with interpolation weights; None if none."""
        pool = self._pools.get((agent, placeholder))
        if not pool:
            self.misses += 1
            return None
        dists = torch.tensor([distance(base, a.base) for a in pool])
        near = (dists <= self.threshold).nonzero().flatten()
        if near.numel() == 0:
            self.misses += 1
            return None
        self.hits += 1
        chosen = [pool[i] for i in near.tolist()]
        for a in chosen:
            a.uses += 1
        return Match(chosen, torch.softmax(-dists[near] / TEMPERATURE, dim=0), float(dists.min()))

    def offsets(self, match: Match, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Interpolated offsets (dk, dv) [L, n, KVH, D] for a segment of n tokens (dk in position-0 frame)."""
        dk = sum(w * fit(a.dk.float(), n) for w, a in zip(match.weights.tolist(), match.anchors))
        dv = sum(w * fit(a.dv.float(), n) for w, a in zip(match.weights.tolist(), match.anchors))
        return dk, dv

    def add(self, anchor: Anchor) -> None:
        pool = self._pools.setdefault((anchor.agent, anchor.placeholder), deque())
        pool.append(anchor)
        while len(pool) > self.max_per_placeholder:
            pool.popleft()                 # the oldest anchor goes
            self.evicted += 1

    def drop_oldest(self) -> bool:
        """Drop the oldest anchor of the oldest pool (the KV budget needs room); False when none is held."""
        for key, pool in self._pools.items():
            if pool:
                pool.popleft()
                self.evicted += 1
                if not pool:
                    del self._pools[key]
                return True
        return False

    def clear(self) -> None:
        self._pools.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pool in list(self._pools.values()) for a in list(pool))

    def stats(self) -> AnchorStats:
        s = AnchorStats(hits=self.hits, misses=self.misses, evicted=self.evicted)
        for pool in list(self._pools.values()):      # read from other threads while the worker adds
            for a in list(pool):
                s.anchors += 1
                s.anchor_bytes += a.nbytes
                s.by_agent[a.agent] = s.by_agent.get(a.agent, 0) + a.nbytes
        return s
