"""The attention backend of one engine step: writes the step's new K/V into their slots, then each
sequence attends over its paged KV, or over the view its reuse method gave it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache.kv_store import KVStore
from ..kernels import cpu_view
from ..model.attention import SMALL_QUERY, sdpa, ungroup
from ..switches import SWITCHES

# Few queries over plain paged KV on CPU in fp32 take the compiled loops (``kernels.cpu_view``: keys and
# values read in place, no gather) where they built (``switches.plain_loops``).


@dataclass
class SeqSlice:
    """One sequence's part of a flat step: its new tokens are q[q_start:q_end]."""

    q_start: int
    q_end: int
    gather: torch.Tensor | None       # slots of its whole context, in order (plain paged KV)
    view: Any = None                  # else a reuse view (``reuse.views.View``) of the context
    q_positions: torch.Tensor | None = None


class PagedAttention:
    """AttentionBackend for one engine step."""

    def __init__(self, store: KVStore, slices: list[SeqSlice], write_slots: torch.Tensor, scale: float):
        self.store, self.slices, self.write_slots, self.scale = store, slices, write_slots, scale

    def _one(self, layer: int, s: SeqSlice, q: torch.Tensor) -> torch.Tensor:
        kc, vc = self.store.k[layer], self.store.v[layer]
        if s.view is not None:
            return s.view.attend(q, s.q_positions, kc, vc, layer, self.scale)
        if SWITCHES.plain_loops and q.shape[0] <= SMALL_QUERY and cpu_view.usable(q, kc):
            return ungroup(cpu_view.attention(q, kc, vc, s.gather, self.scale), q.shape[0])
        return sdpa(q, kc.index_select(0, s.gather), vc.index_select(0, s.gather), self.scale)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store.write(layer, self.write_slots, k, v)
        return self._attend(layer, q)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                   ) -> torch.Tensor | None:
        """A decode-sized step's layer from the fused product's unrotated rows [T, (H + 2 KVH) * D]: RoPE
        and the KV write in one call of the compiled loops, and with them a lone sequence's attention,
        plain or over a view the loops serve in one call (``switches.rope_write``); None where they do not
        serve (``LlamaModel.layer`` then rotates in torch and calls the backend)."""
        kc, vc = self.store.k[layer], self.store.v[layer]
        if not (SWITCHES.rope_write and cpu_view.rope_write_usable(qkv, cos, kc, self.write_slots)
                and sin_signed.is_contiguous()):
            return None
        n, kvh, dim = qkv.shape[0], kc.shape[1], kc.shape[2]
        heads = qkv.shape[1] // dim - 2 * kvh
        s = self.slices[0]
        plain = (len(self.slices) == 1 and s.view is None and SWITCHES.plain_loops and n <= SMALL_QUERY
                 and cpu_view.usable_rows(n, heads, dim, qkv, kc))        # as ``_one`` decides
        view_call = getattr(s.view, "compiled_call", None) if len(self.slices) == 1 else None
        call = view_call(n, heads, qkv, kc, layer) if view_call is not None else None
        if call is not None:                  # a corrected view's attention in the same call
            return ungroup(cpu_view.rope_write_view(qkv, cos, sin_signed, kc, vc, self.write_slots, heads, call,
                                                    self.scale), n)
        q, out = cpu_view.rope_write(qkv, cos, sin_signed, kc, vc, self.write_slots, heads,
                                     s.gather if plain else None, self.scale)
        return ungroup(out, n) if plain else self._attend(layer, q)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Each sequence's attention over its context, the step's KV already written."""
        if len(self.slices) == 1:
            return self._one(layer, self.slices[0], q)
        out = torch.empty_like(q)
        for s in self.slices:
            out[s.q_start:s.q_end] = self._one(layer, s, q[s.q_start:s.q_end])
        return out
