"""The compiled CPU path: few queries over a view by the compiled loops (``kernels.cpu_view``).

Keys and values are read in place from the cache, in the view's ``KeyOrder`` where it has one (its
corrected rows first, so that their terms are whole vectors), every reused key is realigned by
rotating the query, and the low-rank terms are summed from a stack's kept codes and stored bases, which
the loops read as packed here (kept with the stack: pointers, no copies).
"""
from __future__ import annotations

import torch

from ...kernels import cpu_view
from ...model.attention import group_queries, ungroup
from ...switches import SWITCHES
from ..storage.readers import Basis, Coeffs
from .layout import GatheredLayout, Stack


# Few queries over a view on CPU in fp32 take the compiled loops (``kernels.cpu_view``) where they built
# (``switches.compiled_views``).


def _compiled_rows(n: int, heads: int, like: torch.Tensor, view: GatheredLayout, k_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU loops can serve n queries of ``heads`` heads over the view, on ``like``'s
    device and dtype."""
    if not (SWITCHES.compiled_views and cpu_view.usable_rows(n, heads, k_cache.shape[-1], like, k_cache)):
        return False
    if view.widest is None:
        view.widest = max([0] + [u.rank for st in view.stacks for g in st.groups for u in (g[0][0], g[2][0])])
    return view.widest <= cpu_view.MAX_RANK


def one_call(view: GatheredLayout, layer: int, dim: int) -> tuple | None:
    """The one call of the compiled loops for a layer's attention over the view (the usual case):
    (slots, key_class, q_cos, q_sin, tables, held) as ``cpu_view.view_attention`` takes them, ``held``
    being what the stacks' tables point at (kept alive by the caller for the call); None where a stack's
    bases need the per-part calls."""
    rotated = view.cos.shape[0] > 0
    slots, key_class = (view.slots, view.key_class) if view.order is None else (view.order.slots, view.order.key_class)
    tables = [_compiled_table(st, active, layer, view.keep, dim) for st in view.stacks if (active := st.active(layer))]
    if not all(t is not None for t in tables):
        return None
    return (slots, key_class if rotated else None, view.q_cos, view.q_sin,
            [t[0] for t in tables], [t[1] for t in tables])


def _compiled_attention(q: torch.Tensor, view: GatheredLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        layer: int, scale: float) -> torch.Tensor:
    """``_lowrank_attention`` by the compiled CPU loops: keys and values read in place from the cache,
    every reused key realigned by rotating the query (any number of deltas), the low-rank terms summed
    in blocks of rows from the kept codes and the stored bases."""
    q = q.contiguous()
    n, kvh = q.shape[0], k_cache.shape[1]
    call = one_call(view, layer, q.shape[-1])
    if call is not None:
        slots, key_class, q_cos, q_sin, tables, _ = call
        return ungroup(cpu_view.view_attention(q, k_cache, v_cache, slots, key_class, q_cos, q_sin, scale, tables), n)
    rotated = view.cos.shape[0] > 0
    slots, key_class = (view.slots, view.key_class) if view.order is None else (view.order.slots, view.order.key_class)
    key_class = key_class if rotated else None
    scores = cpu_view.scores(q, k_cache, slots, key_class, view.q_cos, view.q_sin)
    qg = group_queries(q, kvh)
    parts = []
    for st in view.stacks:
        active = st.active(layer)
        if not active:
            continue
        rows, group, gs = st.loop_rows(active), st.row_groups(active), st.groups[:active]
        bases, packed = [gr[1] for gr in gs], _compiled_bases(st, 0, active, layer)
        if packed is not None:
            qb = cpu_view.basis_queries(qg, packed)                                   # [NB, KVH, G*n, r]
        elif all(b.plain_identity for b in bases):
            qb = qg.expand(active, *qg.shape).contiguous()
        else:
            qb = (qg @ Basis.stacked(bases, layer, q.dtype).transpose(-1, -2)).contiguous()
        cpu_view.lowrank_scores(scores, rows, group, qb, _compiled_coeffs(st, 0, active, layer, view.keep))
        parts.append((st, active, rows, group, gs))
    out = cpu_view.softmax_pv(n, scores, scale, v_cache, slots)                    # scores become probs
    for st, active, rows, group, gs in parts:
        pu = cpu_view.lowrank_values(scores, rows, group, active, _compiled_coeffs(st, 2, active, layer, view.keep))
        bases, packed = [gr[3] for gr in gs], _compiled_bases(st, 2, active, layer)
        if packed is not None:
            cpu_view.basis_values(pu, packed, out)
        else:
            out += pu.sum(0) if all(b.plain_identity for b in bases) else (pu @ Basis.stacked(bases, layer, q.dtype)).sum(0)
    return ungroup(out, n)


def _compiled_table(st: Stack, active: int, layer: int, keep: bool, dim: int) -> tuple[torch.Tensor, tuple] | None:
    """A stack's part of one layer for ``cpu_view.view_attention``: its packed table and the tensors it
    points at; None where the loops cannot read its bases (the per-part calls serve it). Kept with the
    stack when both sides' codes are (it then costs nothing per step)."""
    key = (active, layer)
    if key in st.tables:
        return st.tables[key]
    kb, vb = _compiled_bases(st, 0, active, layer), _compiled_bases(st, 2, active, layer)
    if kb is None or vb is None:        # before the codes: unkept ones would be joined again per part
        return None
    kc, vc = _compiled_coeffs(st, 0, active, layer, keep), _compiled_coeffs(st, 2, active, layer, keep)
    if (kb.rank or dim) != kc.u.shape[1] or (vb.rank or dim) != vc.u.shape[1]:
        return None
    rows, group = st.loop_rows(active), st.row_groups(active)
    held = (cpu_view.stack_table(rows, group, active, kc, kb, vc, vb), (kc, vc, kb, vb, rows, group))
    if (0, active, layer) in st.compiled and (2, active, layer) in st.compiled:
        st.tables[key] = held
    return held


def _compiled_bases(st: Stack, side: int, active: int, layer: int) -> cpu_view.Bases | None:
    """A stack's bases of one side (0 keys, 2 values) and layer as the compiled loops read them, in
    place (kept with the stack: pointers, no copies); None where they cannot (a basis stored otherwise,
    one that leaves the layer out, a rotated value basis), and torch reads them."""
    key = (side, active, layer)
    if key in st.bases:
        return st.bases[key]
    packed = None
    bases = [g[side + 1] for g in st.groups[:active]]
    if all(b.first <= layer and (side == 0 or b.cos is None) and not (b.identity and b.scale is not None)
           for b in bases):
        stored = [None if b.identity else b.b[layer - b.first] for b in bases]
        scales = [None if b.scale is None else _f32(b.scale[layer - b.first]) for b in bases]
        if all(cpu_view.Bases.supports(t) for t in stored) and len({None if t is None else t.dtype for t in stored}) == 1:
            packed = cpu_view.Bases(stored, scales, [_f32(b.cos) for b in bases], [_f32(b.sin) for b in bases])
    st.bases[key] = packed
    return packed


def _compiled_coeffs(st: Stack, side: int, active: int, layer: int, keep: bool) -> cpu_view.Coeffs:
    """A stack's U of one side for the compiled loops, [KVH, r, R]: its kept int8 codes (kept in that
    layout) and scales as they are, else fp32."""
    key = (side, active, layer)
    if key in st.compiled:
        return st.compiled[key]
    kept = st.kept(side, active, layer) if keep and SWITCHES.keep_codes else None
    if kept is None:
        u = Coeffs.joined(st.coeffs(side, active), layer, torch.float32)
        return cpu_view.Coeffs(u.transpose(1, 2).contiguous())
    scale = None if kept.scale is None else _f32(kept.scale).view(kept.codes.shape[:2])
    c = st.compiled[key] = cpu_view.Coeffs(kept.codes.transpose(1, 2).contiguous(), scale, _f32(kept.channels),
                                           None if kept.row_state is None else kept.row_state.to(torch.int32).contiguous())
    return c


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the compiled loops read it: fp32, contiguous (t itself when it already is)."""
    return None if t is None else t.to(torch.float32).contiguous()
