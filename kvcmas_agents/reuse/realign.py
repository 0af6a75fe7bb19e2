"""Exact RoPE realignment: move cached keys (or, equivalently, queries) by a position delta.

RoPE at position p is a rotation R(p) per frequency pair, so R(delta) R(p) k == R(p + delta) k.
Realignment uses the *pure* rotation cos/sin(delta * inv_freq): the yarn attention factor that the
model's tables fold in already sits on the cached key once, and must not be applied a second time.
Because q . R(delta) k == R(-delta) q . k, attention may rotate the query instead of the keys.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..model.rope import rotate as apply_rope

if TYPE_CHECKING:
    from .storage.delta import LowRankDelta
    from .storage.readers import Basis

# Scalings whose frequencies do not depend on the sequence length, so a rotation by delta is exact.
REALIGNABLE_SCALINGS = ("default", "linear", "llama3", "yarn")
_REASONS = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length",
    "longrope": "longrope switches between short and long factors with the sequence length",
}


class HasInvFreq(Protocol):
    inv_freq: torch.Tensor


def refuses(scaling: dict[str, Any] | None) -> str | None:
    """Why keys under this rope scaling cannot be realigned exactly, or None if they can."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind in REALIGNABLE_SCALINGS:
        return None
    return _REASONS.get(kind, f"rope scaling {kind!r} is not known to have position-independent frequencies")


class Realigner:
    """Rotates RoPE'd tensors by integer position deltas; cos/sin are cached per delta."""

    refuses = staticmethod(refuses)

    def __init__(self, inv_freq: torch.Tensor, max_cached: int = 4096):
        # Angles in fp64 from the same fp32 frequencies the model's tables use: exact to one rounding.
        self.inv_freq = inv_freq.detach().to(torch.float64).cpu()
        self.head_dim = 2 * inv_freq.numel()
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = \
            OrderedDict()

    @classmethod
    def from_rope(cls, rope: HasInvFreq) -> "Realigner":
        """Build from a RotaryEmbedding (or anything with ``inv_freq`` [head_dim // 2])."""
        return cls(rope.inv_freq)

    def cos_sin(self, delta: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Pure-rotation cos/sin [head_dim] for a shift by ``delta`` positions (rotate-half layout)."""
        key = (int(delta), torch.device(device), dtype)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        angles = float(delta) * self.inv_freq
        emb = torch.cat([angles, angles])
        value = (emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype))
        self._cache[key] = value
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return value

    def rotate(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate x [..., head_dim] by ``delta`` positions (in fp32 at least); delta 0 returns x itself."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"last dim {x.shape[-1]} != head_dim {self.head_dim}")
        if delta == 0:
            return x
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        cos, sin = self.cos_sin(delta, work.device, work.dtype)
        return apply_rope(work, cos, sin).to(x.dtype)

    def rotate_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys k [T, KVH, D] rotated at positions p -> as if rotated at p + delta."""
        return self.rotate(k, delta)

    def rotate_queries(self, q: torch.Tensor, delta: int) -> torch.Tensor:
        """R(-delta) q, so that ``rotate_queries(q, d) . k == q . rotate_keys(k, d)``."""
        return self.rotate(q, -delta)

    def rotate_delta(self, state: "LowRankDelta", delta: int) -> "LowRankDelta":
        """Move a correction state's key deviation by ``delta`` positions (value factors are unchanged).

        Each corrected key row is U_k[i] @ B_k, so rotating every row equals rotating B_k's rows. The
        rotation is recorded as the state's ``shift`` and applied when B_k is read (``key_basis``): the
        moved state shares every tensor with the original, so a chain holds no rotated copies.
        """
        return replace(state, shift=state.shift + delta)

    def key_basis(self, state: "LowRankDelta") -> "Basis":
        """The state's B_k, dequantized and rotated by its pending shift when read."""
        return state.key_basis(self.cos_sin(state.shift) if state.shift else None)

    def settle(self, state: "LowRankDelta") -> "LowRankDelta":
        """A copy with the shift applied (B_k rotated, in fp32) and shift 0: for oracles and ``compose``."""
        if not state.shift:
            return state
        return replace(state, k=replace(state.k, b=self.key_basis(state).stored(), basis_scale=None), shift=0)
