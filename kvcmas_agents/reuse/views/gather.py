"""Fast torch path for attention over corrected views: gather, realign and correct keys on the fly.

Paged attention in torch already gathers each layer's context into a temporary tensor before SDPA.
This path does the same for a view: home keys are rotated by their segment's delta and the low-rank
rows are added while gathering, then one SDPA call runs. Nothing outlives the layer, so there is no
per-agent copy of the view. Decode-sized queries instead take the kernel's form (``_lowrank_attention``):
the queries are rotated by minus each segment delta and the low-rank terms go into the scores and the
output. ``view_attention`` is the same math, unbatched; tests check they all agree.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace

import torch

from ...kernels import cpu_view
from ...model.attention import group_queries, grouped_attention, sdpa, ungroup
from ...model.rope import rotate, rotate_, signed_sin
from ..realign import Realigner
from ..storage.readers import Basis, Coeffs, KeptCodes
from .reference import SegmentPiece


Group = tuple[list[Coeffs], Basis, list[Coeffs], Basis]      # (U_k's, B_k, U_v's, B_v) sharing one basis

# Whether views kept for a decode keep their unpacked codes (``Stack.coefficients``); off only to measure
# what keeping them buys (benchmarks/decode_rate.py).
KEEP_CODES = True


@dataclass
class Stack:
    """Groups of a view stored alike (same code format, basis storage and rank), read together: one
    unpack of U and one read of the bases per layer for all of them (on CPU a few ops per group and
    layer cost more than the products; a decode step reads every group in every layer)."""

    groups: list[Group]          # by first stored layer
    firsts: list[int]            # each group's first stored layer, ascending
    ends: list[int]              # each group's end in ``rows``
    rows: torch.Tensor           # [R] their key rows in the view, group by group

    def active(self, layer: int) -> int:
        """How many (leading) groups store ``layer``."""
        return bisect_right(self.firsts, layer)

    # (side, groups, layer) -> the leading groups' U of that side (0 keys, 2 values), kept unpacked
    unpacked: dict[tuple[int, int, int], KeptCodes] = field(default_factory=dict)

    def leading_rows(self, groups: int) -> torch.Tensor:
        """The key rows of the leading ``groups`` groups (a prefix of ``rows``)."""
        return self.rows[:self.ends[groups - 1]]

    def spans(self, groups: int) -> list[tuple[int, int]]:
        """Where each of the leading ``groups`` groups' rows lie in ``rows``."""
        return list(zip([0] + self.ends[:groups - 1], self.ends[:groups]))

    def coefficients(self, side: int, groups: int, layer: int, dtype: torch.dtype,
                     keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The leading ``groups`` groups' U of one side for the low-rank terms (``_coefficients``), read
        from their kept codes when ``keep`` (``read_kept``)."""
        u = self.read_kept(side, groups, layer, dtype, keep)
        return (u, None) if u is not None else _coefficients(self.coeffs(side, groups), layer, dtype)

    def read_kept(self, side: int, groups: int, layer: int, dtype: torch.dtype, keep: bool) -> torch.Tensor | None:
        """U [KVH, R, r] of the leading ``groups`` groups of one side from their kept codes, for a view kept
        for its request (``keep``); None when not kept or the codes cannot be kept."""
        kept = self.kept(side, groups, layer) if keep and KEEP_CODES else None
        return kept.read(dtype) if kept is not None else None

    def kept(self, side: int, groups: int, layer: int) -> KeptCodes | None:
        """The leading ``groups`` groups' U of one side, its packed 6- and 4-bit codes unpacked once per
        layer and kept as int8 (with quantized rows' scales), so each later decode step over the same view
        casts them instead of unpacking them again, which took a third of a decode step on CPU. The kept
        bytes count as the request's state. None for codes that cannot be kept (float factors, states
        that leave the layer out)."""
        key = (side, groups, layer)
        kept = self.unpacked.get(key)
        if kept is None:
            kept = Coeffs.exact_codes(self.coeffs(side, groups), layer)
            if kept is not None:
                self.unpacked[key] = kept
        return kept

    def coeffs(self, side: int, groups: int) -> list[Coeffs]:
        """The leading ``groups`` groups' U factors of one side (0 keys, 2 values), group by group."""
        return [u for g in self.groups[:groups] for u in g[side]]

    def kept_bytes(self) -> int:
        """Bytes of kept codes, with the fp32 copies of their scales the compiled loops keep."""
        copies = {t.data_ptr(): t.numel() * t.element_size() for c in self.compiled.values()
                  for t in (c.scale, c.channels, c.row_state) if t is not None}
        shared = {t.data_ptr() for k in self.unpacked.values() for t in (k.scale, k.channels, k.row_state)
                  if t is not None}
        return sum(k.nbytes for k in self.unpacked.values()) + sum(n for i, n in copies.items() if i not in shared)

    def row_groups(self, groups: int) -> torch.Tensor:
        """Each of the leading ``groups`` groups' rows' group index [R] (int32), for the compiled loops."""
        if self._row_group is None:
            sizes = torch.tensor([b - a for a, b in self.spans(len(self.groups))])
            self._row_group = torch.repeat_interleave(torch.arange(len(self.groups), dtype=torch.int32), sizes)
        return self._row_group[:self.ends[groups - 1]]

    _row_group: torch.Tensor | None = None
    # (side, groups, layer) -> the kept codes as the compiled loops take them (views of ``unpacked``),
    # and the bases as they read them (pointers to the stored ones)
    compiled: dict[tuple[int, int, int], cpu_view.Coeffs] = field(default_factory=dict)
    bases: dict[tuple[int, int, int], cpu_view.Bases | None] = field(default_factory=dict)
    # (groups, layer) -> both sides packed for one call of the loops, and what the table points at
    tables: dict[tuple[int, int], tuple[torch.Tensor, tuple]] = field(default_factory=dict)


@dataclass
class GatheredView:
    slots: torch.Tensor                          # [N] store slots of all keys, in position order
    # [M, 1, D], rotate-half tables (sin signed, ``rope.rotate_``): rows [0, M) are rotated (identity
    # where not reused)
    cos: torch.Tensor
    sin: torch.Tensor
    # The corrections: groups (U_k's, B_k, U_v's, B_v) of states that share one basis (and shift), so
    # that each layer needs one product per basis (none for the identity of full-rank rows), in stacks
    # of groups stored alike.
    stacks: list[Stack]
    first_layer: int                             # layers before it have no corrections (states leave them out)
    # Query-side realignment for few queries: rotation class [N] of every key (0: not rotated, c: by the
    # c-th distinct delta), and the rotate-half tables [C, D] that move a query by minus each delta
    # (row 0 the identity).
    key_class: torch.Tensor
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    # Keep unpacked codes for later steps (``Stack.coefficients``): set on a request's view kept for its
    # decode; views built for one call leave it off.
    keep: bool = False
    widest: int | None = None       # the widest rank the compiled loops would read (once known)

    def kept_bytes(self) -> int:
        """Bytes of unpacked codes this view keeps (``keep``)."""
        return sum(st.kept_bytes() for st in self.stacks)

    def extend(self, slots: torch.Tensor) -> "GatheredView":
        """The same view followed by plain own keys (a request's tail as it grows)."""
        slots = slots.to(self.slots.device)
        return replace(self, slots=torch.cat([self.slots, slots]),
                       key_class=torch.cat([self.key_class, self.key_class.new_zeros(slots.numel())]))

    def attend(self, q: torch.Tensor, q_positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: int, scale: float) -> torch.Tensor:
        """Attention of the view's last len(q) positions (``q_positions`` is implied by the layout)."""
        return gathered_attention(q, self, k_cache, v_cache, layer, scale)


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
                    key = (_basis_id(d.bk, d.uk), _basis_id(d.bv, d.uv), d.shift, d.first_layer)
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
    return GatheredView(torch.cat(slots).to(device), cos, sin, stacks, first, key_class.to(device),
                        torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables]))


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


def _stack_dense(st: Stack, side: int, active: int, layer: int, dtype: torch.dtype, keep: bool) -> torch.Tensor:
    """Corrected rows U . B [R, KVH, D] of one side of a stack's leading ``active`` groups (side 0 keys,
    2 values; U's rows spans[i] have the i-th group's basis). A view kept for its request reads its kept
    codes (the tail's prefill unpacks them once for the decode after it)."""
    bases, spans = [g[side + 1] for g in st.groups[:active]], st.spans(active)
    u = st.read_kept(side, active, layer, dtype, keep)
    if u is None:
        u = Coeffs.joined(st.coeffs(side, active), layer, dtype)
    if all(b.plain_identity for b in bases):
        return u.transpose(0, 1)
    b = Basis.stacked(bases, layer, dtype)                                        # [NB, KVH, r, D]
    return torch.cat([u[:, a:e] @ b[i] for i, (a, e) in enumerate(spans)], dim=1).transpose(0, 1)


def gathered_kv(view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                layer: int, corrected: bool = True, realigned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's corrected keys and values [N, KVH, D] (temporary); ``corrected=False`` leaves out the
    low-rank rows (realigned home keys only), ``realigned=False`` the rotation too (home keys as stored)."""
    k, v = k_cache.index_select(0, view.slots), v_cache.index_select(0, view.slots)   # 2-3x faster than k[idx] on CPU
    m = view.cos.shape[0]
    if m and realigned:
        rotate_(k[:m], view.cos, view.sin)    # k is a fresh gather: rotated in place
    # One scatter for all bases (per-call overhead dominates on CPU); none where no state stores the layer.
    if corrected and view.stacks and layer >= view.first_layer:
        rows, dk, dv = [], [], []
        for st in view.stacks:
            active = st.active(layer)
            if active:
                rows.append(st.leading_rows(active))
                dk.append(_stack_dense(st, 0, active, layer, k.dtype, view.keep))
                dv.append(_stack_dense(st, 2, active, layer, v.dtype, view.keep))
        if not rows:
            return k, v
        idx = torch.cat(rows)
        k.index_add_(0, idx, torch.cat(dk))
        v.index_add_(0, idx, torch.cat(dv))
    return k, v


# Up to this many queries, the low-rank terms go into the scores and the output (G * Tq * r * R work
# per KV head) instead of into R dense key/value rows (r * D * R): decode steps no longer rebuild every
# corrected row of the view in every layer.
LOWRANK_QUERY = 8
# Up to this many rotated queries (queries x rotation classes, the identity included), the queries are
# rotated by minus each segment delta instead of rotating every reused key (R(-d) q . k == q . R(d) k):
# on CPU the key rotation costs about as much as the scores themselves, while each rotated query costs
# one more row of scores, so for one query the break-even is near 9 classes (docs/attention.md).
QUERY_ROTATIONS = 9


def gathered_attention(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layer: int, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over the view; q [Tq, H, D] -> [Tq, H, D]."""
    few = q.shape[0] <= LOWRANK_QUERY
    if few and (view.stacks or view.cos.shape[0]) and _compiled(q, view, k_cache):
        return _compiled_attention(q, view, k_cache, v_cache, layer, scale)
    if few and (view.stacks or _query_side(view, q.shape[0])):     # (also below first_layer: same numerics)
        return _lowrank_attention(q, view, k_cache, v_cache, layer, scale)
    k, v = gathered_kv(view, k_cache, v_cache, layer)
    return sdpa(q, k, v, scale)


def _lowrank_attention(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
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


# Few queries over a view on CPU in fp32 take the compiled loops (``kernels.cpu_view``) where they built;
# off only to measure what they buy.
COMPILED = True


def _compiled(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU loops can serve this attention."""
    if not (COMPILED and cpu_view.usable(q, k_cache)):
        return False
    if view.widest is None:
        view.widest = max([0] + [u.rank for st in view.stacks for g in st.groups for u in (g[0][0], g[2][0])])
    return view.widest <= cpu_view.MAX_RANK


def _compiled_attention(q: torch.Tensor, view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        layer: int, scale: float) -> torch.Tensor:
    """``_lowrank_attention`` by the compiled CPU loops: keys and values read in place from the cache,
    every reused key realigned by rotating the query (any number of deltas), the low-rank terms summed
    in blocks of rows from the kept codes and the stored bases."""
    q = q.contiguous()
    n, kvh = q.shape[0], k_cache.shape[1]
    rotated = view.cos.shape[0] > 0
    tables = [_compiled_table(st, active, layer, view.keep, q.shape[-1])
              for st in view.stacks if (active := st.active(layer))]
    if all(t is not None for t in tables):              # one call for the layer (the usual case)
        out = cpu_view.view_attention(q, k_cache, v_cache, view.slots, view.key_class if rotated else None,
                                      view.q_cos, view.q_sin, scale, [t[0] for t in tables])
        return ungroup(out, n)
    scores = cpu_view.scores(q, k_cache, view.slots, view.key_class if rotated else None, view.q_cos, view.q_sin)
    qg = group_queries(q, kvh)
    parts = []
    for st in view.stacks:
        active = st.active(layer)
        if not active:
            continue
        rows, group, gs = st.leading_rows(active), st.row_groups(active), st.groups[:active]
        bases, packed = [gr[1] for gr in gs], _compiled_bases(st, 0, active, layer)
        if packed is not None:
            qb = cpu_view.basis_queries(qg, packed)                                   # [NB, KVH, G*n, r]
        elif all(b.plain_identity for b in bases):
            qb = qg.expand(active, *qg.shape).contiguous()
        else:
            qb = (qg @ Basis.stacked(bases, layer, q.dtype).transpose(-1, -2)).contiguous()
        cpu_view.lowrank_scores(scores, rows, group, qb, _compiled_coeffs(st, 0, active, layer, view.keep))
        parts.append((st, active, rows, group, gs))
    out = cpu_view.softmax_pv(n, scores, scale, v_cache, view.slots)               # scores become probs
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
    rows, group = st.leading_rows(active), st.row_groups(active)
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
    kept = st.kept(side, active, layer) if keep and KEEP_CODES else None
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


def _coefficients(us: list[Coeffs], layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several groups' U for the low-rank terms: (U [KVH, R, r], None), or for packed codes their
    features and map (F, M) with U = F @ M (``code_features``), which spare few queries the unpack."""
    packed = Coeffs.features(us, layer)
    return packed if packed is not None else (Coeffs.joined(us, layer, dtype), None)


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


def _query_side(view: GatheredView, queries: int) -> bool:
    """Whether ``queries`` queries realign by rotating themselves (the view has rotated keys, few deltas)."""
    return view.cos.shape[0] > 0 and view.q_cos.shape[0] * queries <= QUERY_ROTATIONS


def _realigned_scores(qg: torch.Tensor, k: torch.Tensor, view: GatheredView) -> torch.Tensor:
    """Scores [KVH, G*n, ctx] of queries qg [KVH, G*n, D] over unrotated home keys k [ctx, KVH, D]: each
    key scored by the query moved by minus its segment's delta (one product for all deltas, then each
    key's own column picked)."""
    kvh, rows, dim = qg.shape
    classes, ctx = view.q_cos.shape[0], k.shape[0]
    moved = rotate(qg.unsqueeze(1), view.q_cos.view(1, classes, 1, dim).to(qg.dtype),
                   view.q_sin.view(1, classes, 1, dim).to(qg.dtype))                 # [KVH, C, G*n, D]
    every = (moved.reshape(kvh, classes * rows, dim) @ k.permute(1, 2, 0)).view(kvh, classes, rows, ctx)
    return every.gather(1, view.key_class.view(1, 1, 1, ctx).expand(kvh, 1, rows, ctx)).view(kvh, rows, ctx)


def gathered_mass_attention(q: torch.Tensor, q_positions: torch.Tensor, key_positions: torch.Tensor,
                            view: GatheredView, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Tq, H, D] over the view's keys at ``key_positions`` [N] (any gaps allowed), a key
    visible when its position <= the query's; returns the output [Tq, H, D] and the attention mass [N]
    (fp32) each key receives, summed over heads and queries. The selection pass's backend."""
    k, v = gathered_kv(view, k_cache, v_cache, layer)
    visible = key_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    out, probs = grouped_attention(q.float(), k.float(), v.float(), scale, visible)
    return out.to(q.dtype), probs.sum(dim=(0, 1, 2))
