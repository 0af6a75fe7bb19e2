"""The low-rank path for few queries: the kernel's math in torch, batched per basis.

Decode-sized queries do not rebuild the view's corrected rows: the low-rank terms go into the scores
(``(q . B_k^T) . U_k^T``) and the output (``(P . U_v) . B_v``), and with few rotation classes the
queries are rotated by minus each segment delta instead of every reused key (``_query_side``).
"""
from __future__ import annotations

import torch

from ...model.attention import group_queries, ungroup
from ...model.rope import rotate
from ..storage.readers import Basis
from .dense import gathered_kv
from .layout import GatheredLayout


# Up to this many rotated queries (queries x rotation classes, the identity included), the queries are
# rotated by minus each segment delta instead of rotating every reused key (R(-d) q . k == q . R(d) k):
# on CPU the key rotation costs about as much as the scores themselves, while each rotated query costs
# one more row of scores, so for one query the break-even is near 9 classes (docs/attention.md).
QUERY_ROTATIONS = 9


def _lowrank_attention(q: torch.Tensor, view: GatheredLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layer: int, scale: float) -> torch.Tensor:
    """gathered_attention for few queries: scores += (q . B_k^T) . U_k^T on corrected rows and
    output += (P[:, rows] . U_v) . B_v, over realigned home keys (the kernel's math, batched per basis)."""
    query_side = _query_side(view, q.shape[0])
    k, v = gathered_kv(view, k_cache, v_cache, layer, corrected=False, realigned=not query_side)
    n, heads, _ = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    g = heads // kvh
    qg = group_queries(q, kvh)
    scores = _realigned_scores(qg, k, view) if query_side else qg @ k.permute(1, 2, 0)    # [KVH, G*n, ctx]
    parts = []
    for st in view.stacks:
        active = st.active(layer)                      # groups that store nothing for this layer are left out
        if not active:
            continue
        rows, spans, gs = st.leading_rows(active), st.spans(active), st.groups[:active]
        uk = st.coefficients(0, active, layer, q.dtype, view.keep)
        scores.index_add_(-1, rows, _lowrank_scores(qg, [g[1] for g in gs], uk, spans, layer))
        parts.append((st, active, rows, spans, gs))
    scores = (scores * scale).view(kvh, g, n, ctx)
    if n > 1:
        visible = torch.arange(ctx, device=q.device) <= torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kvh, g * n, ctx)
    out = probs @ v.transpose(0, 1)                                     # [KVH, G*n, D]
    for st, active, rows, spans, gs in parts:
        uv = st.coefficients(2, active, layer, q.dtype, view.keep)
        # (on 2-D: index_select over the last of three dims took ten times as long on CPU)
        picked = probs.view(-1, ctx).index_select(1, rows).view(kvh, g * n, -1)
        out += _lowrank_values(picked, uv, [g[3] for g in gs], spans, layer)
    return ungroup(out, n)


def _lowrank_scores(qg: torch.Tensor, bases: list[Basis], coeffs: tuple[torch.Tensor, torch.Tensor | None],
                    spans: list[tuple[int, int]], layer: int) -> torch.Tensor:
    """(q . B^T) . U^T [KVH, G*n, R] over rows of several groups: U's rows spans[i] have bases[i]."""
    u, m = coeffs
    if m is None and all(b.plain_identity for b in bases):
        return qg @ u.transpose(-1, -2)
    qb = qg @ Basis.stacked(bases, layer, qg.dtype).transpose(-1, -2)             # [NB, KVH, G*n, r]
    if m is not None:               # in fp32: products with the features' bytes cancel to the codes
        qb = qb.float() @ m.T
    return torch.cat([qb[i] @ u[:, a:b].transpose(-1, -2) for i, (a, b) in enumerate(spans)], dim=-1).to(qg.dtype)


def _lowrank_values(p: torch.Tensor, coeffs: tuple[torch.Tensor, torch.Tensor | None], bases: list[Basis],
                    spans: list[tuple[int, int]], layer: int) -> torch.Tensor:
    """(P[:, rows] . U) . B [KVH, G*n, D] summed over several groups; p [KVH, G*n, R], and U's rows
    spans[i] have bases[i]."""
    u, m = coeffs
    if m is None and all(b.plain_identity for b in bases):
        return p @ u
    pf = p if m is None else p.float()
    pu = torch.stack([pf[..., a:b] @ u[:, a:b] for a, b in spans])                # [NB, KVH, G*n, r]
    if m is not None:
        pu = (pu @ m).to(p.dtype)
    return (pu @ Basis.stacked(bases, layer, p.dtype)).sum(0)


def _query_side(view: GatheredLayout, queries: int) -> bool:
    """Whether ``queries`` queries realign by rotating themselves (the view has rotated keys, few deltas)."""
    return view.cos.shape[0] > 0 and view.q_cos.shape[0] * queries <= QUERY_ROTATIONS


def _realigned_scores(qg: torch.Tensor, k: torch.Tensor, view: GatheredLayout) -> torch.Tensor:
    """Scores [KVH, G*n, ctx] of queries qg [KVH, G*n, D] over unrotated home keys k [ctx, KVH, D]: each
    key scored by the query moved by minus its segment's delta (one product for all deltas, then each
    key's own column picked)."""
    kvh, rows, dim = qg.shape
    classes, ctx = view.q_cos.shape[0], k.shape[0]
    moved = rotate(qg.unsqueeze(1), view.q_cos.view(1, classes, 1, dim).to(qg.dtype),
                   view.q_sin.view(1, classes, 1, dim).to(qg.dtype))                 # [KVH, C, G*n, D]
    every = (moved.reshape(kvh, classes * rows, dim) @ k.permute(1, 2, 0)).view(kvh, classes, rows, ctx)
    return every.gather(1, view.key_class.view(1, 1, 1, ctx).expand(kvh, 1, rows, ctx)).view(kvh, rows, ctx)
