"""Attention over corrected views by torch gathering: the view built, and each call sent down its path.

``build_gathered`` lays pieces out as a ``GatheredView``; ``gathered_attention`` serves its attention
by one of three paths that agree (tested): few queries take the compiled CPU loops where they serve
(``compiled``), else the low-rank terms in torch (``lowrank``); more queries gather corrected keys and
values as dense rows for one SDPA call (``dense``). ``view_attention`` is the same math, unbatched.
"""
from __future__ import annotations

import torch

from ...model.attention import sdpa
from ...model.rope import signed_sin
from ..realign import Realigner
from ..storage.readers import Basis, Coeffs
from .compiled import _compiled_attention, _compiled_rows, one_call
from .dense import gathered_kv
from .layout import GatheredLayout, Group, KeyOrder, Stack
from .lowrank import _lowrank_attention, _query_side
from .reference import SegmentPiece


# Up to this many queries, the low-rank terms go into the scores and the output (G * Tq * r * R work
# per KV head) instead of into R dense key/value rows (r * D * R): decode steps no longer rebuild every
# corrected row of the view in every layer.
LOWRANK_QUERY = 8


class GatheredView(GatheredLayout):
    """A view on the gather path: its layout (``build_gathered`` lays it out), attended by
    ``gathered_attention``."""

    def attend(self, q: torch.Tensor, q_positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: int, scale: float) -> torch.Tensor:
        """Attention of the view's last len(q) positions (``q_positions`` is implied by the layout)."""
        return gathered_attention(q, self, k_cache, v_cache, layer, scale)

    def compiled_call(self, n: int, heads: int, like: torch.Tensor, k_cache: torch.Tensor, layer: int) -> tuple | None:
        """What ``gathered_attention`` would hand the compiled loops in one call for n queries at ``layer``
        (``compiled.one_call``), so that a decode step can make that call with its RoPE and KV write;
        None where it takes another path."""
        if not _takes_compiled(self, n, heads, like, k_cache):
            return None
        return one_call(self, layer, k_cache.shape[-1])


def build_gathered(pieces: list, realigner: Realigner, device: torch.device, dtype: torch.dtype) -> GatheredView:
    """Lay out pieces in order (their keys' positions need not be contiguous)."""
    slots, rotations, groups = [], [], {}
    offset = 0
    for p in pieces:
        n = p.slots.numel()
        slots.append(p.slots)
        if isinstance(p, SegmentPiece):
            if p.delta != 0:
                rotations.append((offset, n, p.delta, *realigner.cos_sin(p.delta, device, dtype)))
            for d in p.deltas:
                if d.num_rows:
                    # A group's states must also share their first stored layer: identity bases of
                    # different states (full-rank rows) are alike whatever layers each stores.
                    key = (_basis_id(d.k.b, d.k.u), _basis_id(d.v.b, d.v.u), d.shift, d.first_layer)
                    rows, uks, _, uvs, _ = groups.setdefault(key, ([], [], realigner.key_basis(d), [],
                                                                   d.value_basis()))
                    rows.append(d.rows.to(device) + offset)
                    uks.append(d.key_coeffs())
                    uvs.append(d.value_coeffs())
        offset += n
    m, dim = max((a + n for a, n, _, _, _ in rotations), default=0), realigner.head_dim
    cos = torch.ones(m, 1, dim, device=device, dtype=dtype)
    sin = torch.zeros(m, 1, dim, device=device, dtype=dtype)
    classes = {0: 0}
    key_class = torch.zeros(offset, dtype=torch.long)
    for a, n, delta, c, s in rotations:
        cos[a:a + n], sin[a:a + n] = c, signed_sin(s)
        key_class[a:a + n] = classes.setdefault(delta, len(classes))
    tables = [realigner.cos_sin(-delta, device, dtype) for delta in classes]
    corrections = [(uks, bk, uvs, bv) for _, uks, bk, uvs, bv in groups.values()]
    first = min((u.first for g in corrections for u in g[0] + g[2]), default=0)
    stacks = _stacks(corrections, [torch.cat(g[0]).to(device) for g in groups.values()])
    slots_, key_class = torch.cat(slots).to(device), key_class.to(device)
    return GatheredView(slots_, cos, sin, stacks, first, key_class, torch.stack([c for c, _ in tables]),
                        torch.stack([s for _, s in tables]), order=KeyOrder.of(slots_, key_class, stacks))


def _stacks(corrections: list[Group], rows: list[torch.Tensor]) -> list[Stack]:
    """The groups by storage format, each format's groups ordered by their first stored layer."""
    alike: dict[tuple, list[tuple[Group, torch.Tensor]]] = {}
    for g, r in zip(corrections, rows):
        if len({u.first for u in g[0] + g[2]}) != 1:
            raise ValueError("a group's states must share their first stored layer")
        alike.setdefault(_format(g), []).append((g, r))
    out = []
    for members in alike.values():
        members.sort(key=lambda m: m[0][0][0].first)
        ends = torch.tensor([r.numel() for _, r in members]).cumsum(0).tolist()
        out.append(Stack([g for g, _ in members], [g[0][0].first for g, _ in members], ends,
                         torch.cat([r for _, r in members])))
    return out


def _format(g: Group) -> tuple:
    """What groups read together must share: their U codes' format and their bases' storage and rank."""
    def coeffs(u: Coeffs) -> tuple:
        return u.scale is None, u.tail, u.head, u.bits, u.rank, u.u.dtype, u.channel is not None

    def basis(b: Basis) -> tuple:
        return b.b.dtype, b.scale is None, tuple(b.b.shape[1:]), b.identity
    uks, bk, uvs, bv = g
    return coeffs(uks[0]), basis(bk), coeffs(uvs[0]), basis(bv)


def _basis_id(b: torch.Tensor | None, u: torch.Tensor) -> object:
    """What corrections sharing one basis have in common: the B tensor, or the identity's width."""
    return id(b) if b is not None else ("identity", u.shape[-1], u.dtype)


def _takes_compiled(view: GatheredLayout, n: int, heads: int, like: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether n queries over the view take the compiled loops (``_compiled_attention``)."""
    return n <= LOWRANK_QUERY and bool(view.stacks or view.cos.shape[0]) and _compiled_rows(n, heads, like, view, k_cache)


def gathered_attention(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layer: int, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over the view; q [Tq, H, D] -> [Tq, H, D]."""
    few = q.shape[0] <= LOWRANK_QUERY
    if _takes_compiled(view, q.shape[0], q.shape[1], q, k_cache):
        return _compiled_attention(q, view, k_cache, v_cache, layer, scale)
    if few and (view.stacks or _query_side(view, q.shape[0])):     # (also below first_layer: same numerics)
        return _lowrank_attention(q, view, k_cache, v_cache, layer, scale)
    k, v = gathered_kv(view, k_cache, v_cache, layer)
    return sdpa(q, k, v, scale)
