"""Compact correction states of a segment's corrected rows: quantized rows, or a truncated SVD.

For one segment, the corrected view is ``K_ref + scatter(rows, U_k @ B_k)`` per layer and KV head
(likewise for V), with ``U`` [L, KVH, R, r] and ``B`` [L, KVH, r, D]. Each side (K, V) is
- low rank: a rank-r truncated SVD, singular values folded into U; an int8 U's per-component scales
  fold into B, and an int8 B (``int8_basis``) carries one fp32 scale per component (``sk``/``sv``).
  With ``u8`` only U's leading ``u8`` components keep 8-bit codes: the trailing ones, which hold the
  least of the deviation, are 4-bit codes packed two to a byte at the end of U (``tk``/``tv`` count
  them). With ``head_bits=6`` the leading ones are 6-bit codes instead, four packed in three bytes
  (``hk``/``hv``); or
- full rank (``compress(value_bits=...)`` for the values, ``key_bits=...`` for the keys, and with
  ``small_rows`` any int8 side whose factors would be larger, as ``small_bits`` rows): U is the
  deviation rows themselves, quantized per row to 4, 6 or 8 bits with one bf16 scale per row and head
  (``rk``/``rv``), key rows after dividing by one bf16 scale per channel (``ck``), and B is the
  identity (not stored).
Readers get U through ``Coeffs`` and B through ``Basis``, which dequantize them and, for keys, apply
the state's pending position ``shift``. A state may leave out its leading layers (``first_layer``):
readers then get zeros there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Iterable

import torch

from ...model.rope import rotate
from .code_features import features
from .quant_rows import (BITS, channel_scale, code_bits, dequantize_rows, normalized, pack_nibbles, pack_sixes,
                         quantize_rows, row_width, unpack_nibbles, unpack_sixes)

# Code bits of a factored int8 U's leading components (StorageSpec.u_head_bits): 8, or 6 packed four
# codes to three bytes.
HEAD_BITS: tuple[int, ...] = (6, 8)


@dataclass(frozen=True)
class Format:
    """The codec switches of ``compress``, all off by default (factors in the deviations' dtype, every
    side factored). ``StorageSpec.format`` sets them from the engine's storage settings.

    dtype: the factors' dtype (None: the deviations'); torch.int8 stores U as codes with per-component
        scales folded into a bf16 B (``int8_basis``: B in int8 too, one fp32 scale per component).
    value_bits / key_bits: 4, 6 or 8 keeps that side full rank as quantized rows (0: factored).
    small_rows: with int8 factors, a side whose factors would take more bytes than 8-bit rows keeps
        its rows instead, in ``small_bits``.
    u8: with int8 factors, U's components past the first ``u8`` get 4-bit codes (None: none do).
    head_bits: code bits of U's leading components, 8 or 6.
    """

    dtype: torch.dtype | None = None
    int8_basis: bool = False
    value_bits: int = 0
    key_bits: int = 0
    small_rows: bool = False
    u8: int | None = None
    small_bits: int = 8
    head_bits: int = 8


@dataclass
class LowRankDelta:
    """Deviation of ``rows`` of a segment, per layer and KV head: K rows += uk @ bk, V rows += uv @ bv.

    Key factors live in the positional frame of the view they were computed in; ``shift`` is the
    rotation (in positions) still owed to B_k to move them into the view they now correct (see
    ``Realigner.rotate_delta``), applied when read, so a moved state shares its tensors instead of
    holding a rotated copy. ``sk``/``sv`` [L, KVH, r, 1] are the per-component scales of int8 B factors.
    ``rk``/``rv`` [L, KVH, R, 1] are the per-row scales of a full-rank side's quantized rows (U int8,
    or uint8 packing 6- or 4-bit codes, ``qk``/``qv`` bits each); its B factor is None: the identity. ``ck``/``cv``
    [L, KVH, 1, D] are optional per-channel scales of such rows (shared by the states of a joint basis).
    ``tk``/``tv`` count an int8 U's trailing components stored as 4-bit codes: U's last ``tk // 2``
    columns hold them, two to a byte (so U [L, KVH, R, r - tk // 2]). ``hk``/``hv`` are the bits of
    its leading components' codes: 8 (or 0), or 6 (``pack_sixes``: h components in 3h/4 columns).
    Every tensor above holds layers [first_layer, first_layer + L); the layers before correct nothing
    and store nothing (layer 0's deviation is rounding: see ``Corrector``).
    """

    rows: torch.Tensor          # LongTensor [R], unique indices into the segment's tokens
    uk: torch.Tensor            # [L, KVH, R, r]
    bk: torch.Tensor | None     # [L, KVH, r, D]; None: identity (full-rank quantized rows)
    uv: torch.Tensor            # [L, KVH, R, r]
    bv: torch.Tensor | None     # [L, KVH, r, D]
    sk: torch.Tensor | None = None
    sv: torch.Tensor | None = None
    shift: int = 0
    rk: torch.Tensor | None = None
    rv: torch.Tensor | None = None
    ck: torch.Tensor | None = None
    cv: torch.Tensor | None = None
    first_layer: int = 0
    tk: int = 0
    tv: int = 0
    qk: int = 0                 # bits of quantized key rows (0 with rk: what the codes' dtype says)
    qv: int = 0
    hk: int = 0                 # bits of an int8 U's leading (not 4-bit) components: 0 or 8, or 6
    hv: int = 0

    def __post_init__(self) -> None:
        if self.first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {self.first_layer}")
        for name, u, r in (("qk", self.uk, self.rk), ("qv", self.uv, self.rv)):
            bits = getattr(self, name)
            if r is None and bits:
                raise ValueError(f"{name}={bits}: only quantized rows (with row scales) have code bits")
            if r is not None:
                setattr(self, name, code_bits(u, bits))
        layers, heads, nrows, _ = self.uk.shape
        if self.rows.shape != (nrows,) or self.uv.shape[:3] != (layers, heads, nrows):
            raise ValueError(f"rows {tuple(self.rows.shape)} do not match factors {tuple(self.uk.shape)}")
        for u, b, r, c, t, q, h in ((self.uk, self.bk, self.rk, self.ck, self.tk, self.qk, self.hk),
                                    (self.uv, self.bv, self.rv, self.cv, self.tv, self.qv, self.hv)):
            if r is None and (u.dtype == torch.uint8 or b is None):
                raise ValueError("a low-rank state needs B factors (only quantized rows with row scales have none)")
            if r is not None and (u.dtype not in (torch.int8, torch.uint8) or r.shape != (*u.shape[:3], 1)):
                raise ValueError("quantized rows are int8 or uint8 (4- or 6-bit) with row scales [L, KVH, R, 1]")
            if t and (t < 0 or t % 2 or r is not None or u.dtype != torch.int8 or t // 2 > u.shape[3]):
                raise ValueError(f"4-bit components come in pairs at the end of an int8 U factor, got {t}")
            if h not in (0, 6, 8) or (h == 6 and (r is not None or u.dtype != torch.int8
                                                  or (u.shape[3] - t // 2) % 3)):
                raise ValueError(f"an int8 U's leading components have 8- or 6-bit codes (6: in columns of "
                                 f"three bytes per four), got {h} bits over {u.shape[3] - t // 2} columns")
            rank = row_width(u, q) if r is not None else plain_rank(u.shape[3], t, h)
            if c is not None and (r is None or c.shape != (layers, heads, 1, rank)):
                raise ValueError("channel scales [L, KVH, 1, D] belong to quantized rows only")
            if b is not None and b.shape[:3] != (layers, heads, rank):
                raise ValueError("U and B factors disagree on rank or layout")
        for b, s in ((self.bk, self.sk), (self.bv, self.sv)):
            if b is None:
                if s is not None:
                    raise ValueError("an identity basis has no scales")
                continue
            if (s is None) != (b.dtype != torch.int8) or (s is not None and s.shape != (*b.shape[:3], 1)):
                raise ValueError("int8 B factors need scales [L, KVH, r, 1], and only they have scales")

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "LowRankDelta":
        """A state that corrects nothing (R = 0, r = 0)."""
        u = torch.zeros(num_layers, kv_heads, 0, 0, dtype=dtype, device=device)
        b = torch.zeros(num_layers, kv_heads, 0, head_dim, dtype=dtype, device=device)
        return cls(torch.zeros(0, dtype=torch.long, device=device), u, b, u.clone(), b.clone())

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def num_layers(self) -> int:
        """Layers the state spans, the uncorrected leading ones included."""
        return self.first_layer + self.uk.shape[0]

    @property
    def rank(self) -> int:
        """Largest of the key and value ranks (head_dim for full-rank rows)."""
        return max(self.key_coeffs().rank, self.value_coeffs().rank)

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the state's tensors, rows and scales included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        own = (self.rows, self.uk, self.uv) + tuple(t for t in (self.rk, self.rv) if t is not None)
        return own + self.basis_tensors()

    def basis_tensors(self) -> tuple[torch.Tensor, ...]:
        """The B factors and their scales, and the rows' channel scales (what a joint basis shares)."""
        return tuple(t for t in (self.bk, self.sk, self.bv, self.sv, self.ck, self.cv) if t is not None)

    def key_coeffs(self) -> "Coeffs":
        """U_k as readers need it (dequantized when read)."""
        return Coeffs(self.uk, self.rk, self.ck, self.first_layer, self.tk, self.qk, self.hk)

    def value_coeffs(self) -> "Coeffs":
        return Coeffs(self.uv, self.rv, self.cv, self.first_layer, self.tv, self.qv, self.hv)

    def key_basis(self, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> "Basis":
        """B_k as readers need it; ``cos_sin`` rotates it by ``shift`` (``Realigner.key_basis`` passes it)."""
        if self.shift and cos_sin is None:
            raise ValueError(f"this state's keys still owe a rotation by {self.shift}: read them through "
                             "Realigner.key_basis")
        return Basis(self._basis(self.bk, self.uk, self.qk), self.sk, *(cos_sin if self.shift else (None, None)),
                     identity=self.bk is None, first=self.first_layer)

    def value_basis(self) -> "Basis":
        return Basis(self._basis(self.bv, self.uv, self.qv), self.sv, identity=self.bv is None, first=self.first_layer)

    @staticmethod
    def _basis(b: torch.Tensor | None, u: torch.Tensor, bits: int) -> torch.Tensor:
        return b if b is not None else _eye(*u.shape[:2], row_width(u, bits), u.device)

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed deviations (dk, dv), each [KVH, R, D] in fp32, for one layer (shift 0 only)."""
        return (self.key_coeffs().at(layer) @ self.key_basis().at(layer),
                self.value_coeffs().at(layer) @ self.value_basis().at(layer))

    def to(self, device: torch.device | str) -> "LowRankDelta":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LowRankDelta(*(move(t) for t in (self.rows, self.uk, self.bk, self.uv, self.bv, self.sk, self.sv)),
                            shift=self.shift, rk=move(self.rk), rv=move(self.rv), ck=move(self.ck), cv=move(self.cv),
                            first_layer=self.first_layer, tk=self.tk, tv=self.tv, qk=self.qk, qv=self.qv,
                            hk=self.hk, hv=self.hv)


@lru_cache(maxsize=16)
def _eye(layers: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """An identity basis [L, KVH, D, D] (an expanded view: it holds D * D floats)."""
    return torch.eye(dim, device=device).expand(layers, heads, dim, dim)


def _layer_of(first: int, layer: int | slice, read: Callable[[int | slice], torch.Tensor],
              shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``read(layer - first)``, with zeros of one layer's ``shape`` for the ``first`` layers a state
    does not store: one layer (an int) or all of them (``slice(None)``, zeros stacked in front)."""
    if not first:
        return read(layer)
    if isinstance(layer, int):
        return read(layer - first) if layer >= first else like.new_zeros(shape, dtype=dtype)
    if layer != slice(None):
        raise ValueError("a state without its leading layers is read one layer at a time, or whole")
    return torch.cat([like.new_zeros((first, *shape), dtype=dtype), read(slice(None))])


@dataclass
class KeptCodes:
    """Several states' U of one layer kept unpacked for a decode (``Coeffs.exact_codes``): int8 codes
    [KVH, R, r] (stored transposed, [KVH, r, R] in memory: the compiled CPU loops run along rows), and
    for quantized rows their row scales [KVH, R, 1] and, where a state has them, the
    channel scales: one table [KVH, S, D] of the states' scales (ones for a state without) and each
    row's state [R] in it."""

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    channels: torch.Tensor | None = None
    row_state: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.codes = self.codes.transpose(1, 2).contiguous().transpose(1, 2)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        u = self.codes.to(dtype)
        if self.scale is not None:
            u.mul_(self.scale.to(dtype))
        if self.channels is not None:        # as Coeffs.joined scales them, by one gather of the table
            u.mul_(self.channels.to(dtype).index_select(1, self.row_state))
        return u

    @staticmethod
    def channel_table(channels: list[tuple[torch.Tensor | None, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [KVH, S, D], row states [R] int32) of per-state channel scales [KVH, 1, D] (or None: ones),
        each given with its number of rows."""
        like = next(c for c, _ in channels if c is not None)
        table = torch.cat([c if c is not None else torch.ones_like(like) for c, _ in channels], dim=1)
        rows = torch.repeat_interleave(torch.arange(len(channels), dtype=torch.int32),
                                       torch.tensor([n for _, n in channels]))
        return table, rows.to(like.device)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + sum(t.numel() * t.element_size() for t in
                                        (self.scale, self.channels, self.row_state) if t is not None)


@dataclass(frozen=True)
class Coeffs:
    """A U factor [L, KVH, R, r] as read: plain (its last ``tail`` components 4-bit codes packed in
    its last ``tail // 2`` columns, its leading ones ``head``-bit codes: 8 or 0, or 6), or quantized
    rows of ``codes`` bits dequantized by their row ``scale`` (and, if given, their ``channel`` scales
    [L, KVH, 1, D]); layers before ``first`` read as zeros."""

    u: torch.Tensor
    scale: torch.Tensor | None = None
    channel: torch.Tensor | None = None
    first: int = 0
    tail: int = 0
    codes: int = 0
    head: int = 0

    @property
    def rank(self) -> int:
        return row_width(self.u, self.codes) if self.scale is not None else plain_rank(self.u.shape[-1], self.tail,
                                                                                        self.head)

    @property
    def bits(self) -> int:
        """Bits per code of quantized rows (4, 6 or 8); 0 for factors."""
        return 0 if self.scale is None else code_bits(self.u, self.codes)

    @property
    def num_rows(self) -> int:
        return self.u.shape[2]

    @staticmethod
    def joined(us: list["Coeffs"], layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Several U factors' ``at(layer)`` side by side [KVH, sum R_i, r]. Plain factors (int8 by
        default) are joined before one cast: a decode step reads every state of its view in every layer,
        and a cast per state was a fifth of a kvcmas decode step's op time on CPU. States may start at
        different layers (``uncorrected_energy``): a layer that every one of them stores is joined too."""
        if len(us) == 1:
            return us[0].at(layer, dtype)
        if any(layer < u.first for u in us):
            return torch.cat([u.at(layer, dtype) for u in us], dim=1)
        codes = Coeffs._plain_codes(us, layer)
        if codes is not None:
            return _plain(codes, us[0].tail, dtype, us[0].head)
        idx = [layer - u.first for u in us]
        if all(u.scale is not None and u.bits == us[0].bits for u in us):
            # quantized rows (small corrections, or key_bits/value_bits): one dequantization, then
            # each state's channel scales over its own rows
            rows = dequantize_rows(torch.cat([u.u[i] for u, i in zip(us, idx)], dim=1),
                                   torch.cat([u.scale[i] for u, i in zip(us, idx)], dim=1), dtype, us[0].bits)
            if any(u.channel is not None for u in us):
                rows.mul_(torch.cat([(u.channel[i] if u.channel is not None else rows.new_ones(1, 1, 1))
                                     .to(dtype).expand(rows.shape[0], u.num_rows, rows.shape[2])
                                     for u, i in zip(us, idx)], dim=1))
            return rows
        return torch.cat([u.at(layer, dtype) for u in us], dim=1)

    @staticmethod
    def features(us: list["Coeffs"], layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Several packed U factors' codes side by side as features (``code_features``): F [KVH, sum R_i,
        2w + 1] fp32 and M [2w + 1, r] with ``F @ M == joined(us, layer)``. For plain int8 factors with
        6-bit leading codes or a 4-bit tail that all store ``layer``; None for any other storage."""
        first = us[0]
        if first.u.dtype != torch.int8 or not (first.head == 6 or first.tail):
            return None
        codes = Coeffs._plain_codes(us, layer)
        return None if codes is None else features(codes, first.tail, first.head)

    @staticmethod
    def exact_codes(us: list["Coeffs"], layer: int) -> "KeptCodes | None":
        """``joined(us, layer)`` as int8 codes (exact: they are small integers) and what scales them back
        (``KeptCodes.read`` is ``joined`` to the bit); None for float factors or states that leave the layer
        out."""
        if us[0].u.dtype == torch.int8 and Coeffs._plain_codes(us, layer) is not None:
            return KeptCodes(Coeffs.joined(us, layer, torch.float32).to(torch.int8))
        if any(layer < u.first or u.scale is None or u.bits != us[0].bits for u in us):
            return None
        idx = [layer - u.first for u in us]
        scale = torch.cat([u.scale[i] for u, i in zip(us, idx)], dim=1)
        codes = dequantize_rows(torch.cat([u.u[i] for u, i in zip(us, idx)], dim=1), torch.ones_like(scale),
                                torch.float32, us[0].bits)
        if not any(u.channel is not None for u in us):
            return KeptCodes(codes.to(torch.int8), scale)
        table, rows = KeptCodes.channel_table([(u.channel[i] if u.channel is not None else None, u.num_rows)
                                               for u, i in zip(us, idx)])
        return KeptCodes(codes.to(torch.int8), scale, table, rows)

    @staticmethod
    def _plain_codes(us: list["Coeffs"], layer: int) -> torch.Tensor | None:
        """Plain factors' stored ``layer`` side by side [KVH, sum R_i, w], as stored (not unpacked), if
        every one is plain, laid out alike (tail, head, dtype) and stores ``layer``; else None."""
        first = us[0]
        if any(u.scale is not None or u.tail != first.tail or u.head != first.head or u.u.dtype != first.u.dtype
               or layer < u.first for u in us):
            return None
        if len(us) == 1:
            return first.u[layer - first.first]
        return torch.cat([u.u[layer - u.first] for u in us], dim=1)

    def at(self, layer: int | slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One layer's coefficients [KVH, R, r] (or all of them for the default slice), in ``dtype``."""
        return _layer_of(self.first, layer, lambda i: self._stored(i, dtype),
                         (*self.u.shape[1:3], self.rank), self.u, dtype)

    def _stored(self, layer: int | slice, dtype: torch.dtype) -> torch.Tensor:
        if self.scale is None:
            return _plain(self.u[layer], self.tail, dtype, self.head)
        rows = dequantize_rows(self.u[layer], self.scale[layer], dtype, self.codes)
        return rows if self.channel is None else rows.mul_(self.channel[layer].to(dtype))


def plain_rank(width: int, tail: int, head: int) -> int:
    """Components of a plain U ``width`` columns wide: ``tail`` 4-bit ones in the last ``tail // 2``
    columns, the leading ones ``head``-bit codes (6: four in three columns)."""
    lead = width - tail // 2
    return (lead * 4 // 3 if head == 6 else lead) + tail


def _plain(u: torch.Tensor, tail: int, dtype: torch.dtype, head: int = 0) -> torch.Tensor:
    """A plain U's codes [..., w] in ``dtype``: the ``tail`` 4-bit components in its last columns, and
    6-bit leading ones (``head``), unpacked."""
    w = u.shape[-1] - tail // 2
    lead = unpack_sixes(u[..., :w].view(torch.uint8), dtype) if head == 6 else None
    if not tail:
        return u.to(dtype) if lead is None else lead
    lead = u[..., :w].to(dtype) if lead is None else lead
    return torch.cat([lead, unpack_nibbles(u[..., w:].view(torch.uint8), dtype)], dim=-1)


@dataclass(frozen=True)
class Basis:
    """A B factor [L, KVH, r, D] as read: dequantized by ``scale`` and rotated by cos/sin [D] if given.
    ``identity``: B is the identity (full-rank rows); with no rotation, readers may skip the product.
    Layers before ``first`` read as zeros."""

    b: torch.Tensor
    scale: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    identity: bool = False
    first: int = 0

    @property
    def plain_identity(self) -> bool:
        """The identity, not rotated: U @ B is U itself."""
        return self.identity and self.cos is None

    def at(self, layer: int | slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One layer's basis [KVH, r, D] (or all of them for the default slice), in ``dtype``."""
        return _layer_of(self.first, layer, lambda i: self.stored(i, dtype), tuple(self.b.shape[1:]), self.b, dtype)

    @staticmethod
    def stacked(bases: list["Basis"], layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Several bases' ``at(layer)`` stacked [NB, KVH, r, D], dequantized and rotated together: a
        decode step reads every basis of its view in every layer, and on CPU a few ops per basis
        cost more than the products. Bases stored alike (same dtype, scaled or not, same shape) whose
        states all store ``layer`` take one op per step for all of them; others are read one by one."""
        first = bases[0]
        alike = all(b.b.dtype == first.b.dtype and (b.scale is None) == (first.scale is None)
                    and b.b.shape[1:] == first.b.shape[1:] and b.first <= layer for b in bases)
        if len(bases) == 1 or not alike:
            return torch.stack([b.at(layer, dtype) for b in bases])
        x = torch.stack([b.b[layer - b.first] for b in bases])
        turned = [b for b in bases if b.cos is not None]
        if first.scale is None and not turned:
            return x.to(dtype)
        x = x.float()
        if first.scale is not None:
            x = x * torch.stack([b.scale[layer - b.first] for b in bases])
        if turned:          # unrotated bases get the identity rotation (cos 1, sin 0): x * 1 + y * 0 == x
            dim = x.shape[-1]
            one, zero = x.new_ones(dim), x.new_zeros(dim)
            cos = torch.stack([one if b.cos is None else b.cos.to(x.device, torch.float32) for b in bases])
            sin = torch.stack([zero if b.sin is None else b.sin.to(x.device, torch.float32) for b in bases])
            x = rotate(x, cos.view(len(bases), 1, 1, dim), sin.view(len(bases), 1, 1, dim))
        return x.to(dtype)

    def stored(self, layer: int | slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Like ``at``, but indexed over the stored layers only (layer ``first`` is index 0)."""
        if self.scale is None and self.cos is None:
            return self.b[layer].to(dtype)      # the default bf16 B on a decode step: one cast, no fp32 detour
        x = self.b[layer].float()
        if self.scale is not None:
            x = x * self.scale[layer]
        if self.cos is not None:
            x = rotate(x, self.cos.to(x.device, torch.float32), self.sin.to(x.device, torch.float32))
        return x.to(dtype)


def _truncated(d: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched truncated SVD of d [..., R, D] -> (U * S [..., R, r], Vh [..., r, D]).

    Computed from the eigendecomposition of the smaller Gram matrix (d^T d or d d^T, in fp64): for the
    small matrices here that is several times faster than ``torch.linalg.svd`` and, in fp64, as accurate
    for the leading components that are kept.
    """
    rows, dim = d.shape[-2], d.shape[-1]
    r = min(rank, rows, dim)
    if r == 0:
        return d.new_zeros(*d.shape[:-1], 0, dtype=dtype), d.new_zeros(*d.shape[:-2], 0, dim, dtype=dtype)
    x = d.double()
    if rows >= dim:
        _, vecs = torch.linalg.eigh(x.transpose(-1, -2) @ x)          # ascending eigenvalues
        v = vecs[..., -r:].flip(-1)                                     # [..., D, r], leading first
        return (x @ v).to(dtype), v.transpose(-1, -2).to(dtype)
    _, vecs = torch.linalg.eigh(x @ x.transpose(-1, -2))
    u = vecs[..., -r:].flip(-1)                                         # [..., R, r]
    return u.to(dtype), (u.transpose(-1, -2) @ x).to(dtype)


def _int8(x: torch.Tensor, dim: int, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x as int8 codes in [-top, top] with one symmetric scale per slice along ``dim`` (the max
    magnitude maps to ``top``)."""
    if not x.numel():
        return x.to(torch.int8), x.new_ones(*(1 if d == dim % x.dim() else n for d, n in enumerate(x.shape)))
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    return torch.round(x / scale).clamp_(-top, top).to(torch.int8), scale


def u_tail(rank: int, u8: int | None) -> int:
    """How many of ``rank`` components get 4-bit codes when ``u8`` keep 8 bits (an even count: they
    pair up in bytes, so an odd remainder leaves one more component at 8 bits)."""
    return 0 if u8 is None else max(0, rank - u8) // 2 * 2


def head_codes(rank: int, u8: int | None, head_bits: int) -> int:
    """Bits of the codes of a rank-``rank`` int8 U's leading components (those ``u_tail`` leaves at 8
    bits): ``head_bits``, except that 6-bit codes pack four to three bytes, so a count not divisible by
    four (or none) keeps 8."""
    lead = rank - u_tail(rank, u8)
    return 6 if head_bits == 6 and lead and lead % 4 == 0 else 8


def _quantized(u: torch.Tensor, b: torch.Tensor, int8_basis: bool, u8: int | None = None,
               head_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """U [..., R, r] in int8 with one scale per component, folded into B ((U_q s) B == U_q (s B)).
    B stays bf16 (no scale left), or with ``int8_basis`` is quantized too, leaving one fp32 scale
    [..., r, 1] per component. With ``u8``, components past the first ``u8`` get 4-bit codes (their
    own scales, folded alike) packed two to a byte after the 8-bit ones: the SVD orders components by
    size, so the trailing ones' coarser rounding is small against the leading ones'. With
    ``head_bits=6`` the leading components get 6-bit codes, packed four to three bytes (``head_codes``
    says whether they can). Returns (U_q, B, B's scale or None, number of 4-bit components, leading
    codes' bits)."""
    tail = u_tail(u.shape[-1], u8)
    head = u.shape[-1] - tail
    bits = head_codes(u.shape[-1], u8, head_bits)
    u_q, su = _int8(u[..., :head], dim=-2, top=2 ** (bits - 1) - 1)
    if bits == 6:
        u_q = pack_sixes(u_q).view(torch.int8)
    if tail:
        u_4, s4 = _int8(u[..., head:], dim=-2, top=7)
        u_q, su = torch.cat([u_q, pack_nibbles(u_4).view(torch.int8)], -1), torch.cat([su, s4], -1)
    b = b * su.transpose(-1, -2)
    if not int8_basis:
        return u_q, b.to(torch.bfloat16), None, tail, bits
    b_q, sb = _int8(b, dim=-1)
    return u_q, b_q, sb.float(), tail, bits


def compress(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, rank: int, fmt: Format = Format(),
             first_layer: int = 0) -> LowRankDelta:
    """Truncated SVD of deviations dk/dv [L, KVH, R, D] of segment ``rows`` [R] to rank ``rank``.

    Keeps min(rank, R, D) components, so a rank >= min(R, D) reconstructs exactly. The SVD runs in fp64;
    ``fmt`` says how the result is stored (see ``Format``): int8 U codes (``_quantized``), a side kept
    as quantized rows (each key channel divided first by its scale over the rows,
    ``quant_rows.channel_scale``; no SVD runs for such a side), small corrections as rows
    (``rows_are_smaller``). Layers before ``first_layer`` are dropped: the state corrects nothing there.
    """
    if dk.shape != dv.shape or dk.dim() != 4:
        raise ValueError(f"dk {tuple(dk.shape)} and dv {tuple(dv.shape)} must both be [L, KVH, R, D]")
    if not 0 <= first_layer < dk.shape[0]:
        raise ValueError(f"first_layer must be in [0, {dk.shape[0]}), got {first_layer}")
    if rows.shape != (dk.shape[2],):
        raise ValueError(f"rows {tuple(rows.shape)} must be [R] with R = {dk.shape[2]}")
    if rows.unique().numel() != rows.numel():
        raise ValueError("rows must be unique")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    dtype, int8_basis, value_bits, key_bits = fmt.dtype or dk.dtype, fmt.int8_basis, fmt.value_bits, fmt.key_bits
    u8, small_bits, head_bits = fmt.u8, fmt.small_bits, fmt.head_bits
    rows = rows.to(device=dk.device, dtype=torch.long)
    small = fmt.small_rows and dtype == torch.int8
    if small and small_bits not in BITS:
        raise ValueError(f"small_bits must be one of {BITS}, got {small_bits!r}")
    if head_bits not in HEAD_BITS:
        raise ValueError(f"head_bits must be one of {HEAD_BITS}, got {head_bits!r}")
    if small and not key_bits and rows_are_smaller(dk.shape[2], dk.shape[3], rank, channels=True):
        key_bits = small_bits
    if small and not value_bits and rows_are_smaller(dv.shape[2], dv.shape[3], rank, channels=False):
        value_bits = small_bits
    uk, bk, sk, rk, ck, tk, hk = _side(dk[first_layer:], rank, dtype, int8_basis, key_bits, u8, head_bits, True)
    uv, bv, sv, rv, cv, tv, hv = _side(dv[first_layer:], rank, dtype, int8_basis, value_bits, u8, head_bits, False)
    return LowRankDelta(rows, uk, bk, uv, bv, sk, sv, rk=rk, rv=rv, ck=ck, cv=cv, first_layer=first_layer,
                        tk=tk, tv=tv, qk=key_bits if rk is not None else 0, qv=value_bits if rv is not None else 0,
                        hk=hk, hv=hv)


# The yardstick of rows_are_smaller, whatever bits the rows it picks are then stored in (small_bits):
# the choice of which corrections are rows was measured for fidelity at this size.
SMALL_ROW_BITS = 8


def rows_are_smaller(rows: int, dim: int, rank: int, channels: bool) -> bool:
    """Whether ``rows`` deviation rows of width ``dim`` take fewer bytes per layer and KV head as
    8-bit rows (one bf16 scale per row, and per channel for keys) than as rank-``rank`` factors with
    an int8 U and a bf16 B. At rank 40 and head_dim 64 that is below about 190 rows: a request that
    corrects only its newest reply. The rows are then also near exact, against 1-2% of the energy
    lost by its SVD. The comparison stays with those factors when they are stored smaller (an int8 B,
    a 4-bit tail of U): moving it would trade more fidelity for fewer bytes than the 4-bit tail does
    (docs/storage.md)."""
    r = min(rank, rows, dim)
    return rows * (dim * SMALL_ROW_BITS // 8 + 2) + (2 * dim if channels else 0) < rows * r + 2 * r * dim


def _side(d: torch.Tensor, rank: int, dtype: torch.dtype, int8_basis: bool, bits: int, u8: int | None,
          head_bits: int, channels: bool) -> tuple:
    """(U, B, B's scale, row scales, channel scales, 4-bit components, leading codes' bits or 0) of one
    side: quantized rows with ``bits`` (B the identity; ``channels`` divides each channel by its scale
    first), else factored."""
    if not bits:
        u, b, sb, tail, head = _factored(d, rank, dtype, int8_basis, u8, head_bits)
        return u, b, sb, None, None, tail, head
    c = channel_scale(d) if channels else None
    u, r = quantize_rows(d if c is None else normalized(d, c), bits)
    return u, None, None, r, c, 0, 0


def _factored(d: torch.Tensor, rank: int, dtype: torch.dtype, int8_basis: bool, u8: int | None,
              head_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """(U, B, B's scale or None, 4-bit components, leading codes' bits or 0) of one side, stored in ``dtype``."""
    if dtype == torch.int8:
        return _quantized(*_truncated(d, rank, torch.float32), int8_basis, u8, head_bits)
    return (*_truncated(d, rank, dtype), None, 0, 0)


def compress_joint(dks: list[torch.Tensor], dvs: list[torch.Tensor], rows: list[torch.Tensor], rank: int,
                   fmt: Format = Format(), first_layer: int = 0) -> list[LowRankDelta]:
    """Compress several segments' deviations (each [L, KVH, R_i, D]) against one shared basis.

    The segments an agent corrects in one request deviate for the same reason (its own prefix), so
    one rank-``rank`` basis B per layer and KV head serves them all: each segment keeps only its rows'
    coefficients U_i, and the r x D basis is stored once instead of once per segment (so are the
    channel scales of key rows, with ``key_bits``). ``small_rows`` decides on all the segments' rows.
    """
    if not (len(dks) == len(dvs) == len(rows)) or not dks:
        raise ValueError("compress_joint needs one dk, dv and rows per segment")
    dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)
    joint = compress(dk, dv, torch.arange(dk.shape[2], device=dk.device), rank, fmt, first_layer)   # split below
    out, offset = [], 0
    for r in rows:
        n = r.numel()
        # Own copies of the row-indexed tensors (not views), so each segment's bytes are its own; B is shared.
        cut = lambda t: None if t is None else t[:, :, offset:offset + n].clone()  # noqa: E731
        out.append(replace(joint, rows=r.to(device=joint.uk.device, dtype=torch.long), uk=cut(joint.uk),
                           uv=cut(joint.uv), rk=cut(joint.rk), rv=cut(joint.rv)))
        offset += n
    return out


def strongest_rows(dks: list[torch.Tensor], dvs: list[torch.Tensor], keep: float) -> list[torch.Tensor]:
    """Boolean masks [R_i] over several segments' rows (deviations [L, KVH, R_i, D] each): the fewest
    rows, strongest first, that hold at least ``keep`` of the summed squared deviation (K and V, all
    layers and heads). A row outside them deviates little from its reference, so storing it costs U
    bytes for almost no correction; ``keep`` >= 1 keeps every row."""
    energy = [(k.float() ** 2).sum((0, 1, 3)) + (v.float() ** 2).sum((0, 1, 3)) for k, v in zip(dks, dvs)]
    if keep >= 1.0 or not energy:
        return [torch.ones_like(e, dtype=torch.bool) for e in energy]
    flat = torch.cat(energy)
    order = flat.argsort(descending=True)
    before = flat[order].cumsum(0) - flat[order]          # energy of the stronger rows
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order[before < keep * flat.sum()]] = True
    return list(chosen.split([e.numel() for e in energy]))


def layer_energy(ds: list[torch.Tensor]) -> torch.Tensor:
    """Squared deviation per layer [L] (fp64), summed over several segments' deviations [L, KVH, R_i, D]."""
    return sum((d.float() ** 2).sum((1, 2, 3)) for d in ds).double()


def faint_layers(dks: list[torch.Tensor], dvs: list[torch.Tensor], share: float) -> int:
    """How many leading layers of several segments' deviations (each [L, KVH, R_i, D]) hold together at
    most ``share`` of the keys' squared deviation and at most ``share`` of the values' (each side
    against its own total, summed over the segments). Deviations grow with depth (a few hundredths of a
    percent of the energy in layer 1, most of it past the middle), so the first layers' corrections
    cost as many bytes as the last ones' for far less correction."""
    if share <= 0.0 or not dks:
        return 0
    per_layer = [layer_energy(dks), layer_energy(dvs)]
    within = [(e.cumsum(0) <= share * e.sum()) for e in per_layer]
    ok = (within[0] & within[1]).long()
    return int(ok.cumprod(0).sum())                     # the leading run of layers within the share


def unique_nbytes(deltas: Iterable[LowRankDelta], bases_only: bool = False) -> int:
    """Bytes held by these deltas, counting a tensor shared by several of them (a joint basis) once;
    ``bases_only`` counts only the B factors (with their scales)."""
    seen: set[int] = set()
    total = 0
    for d in deltas:
        for t in (d.basis_tensors() if bases_only else d.tensors()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def captured_energy(d: torch.Tensor, rank: int, reduce: bool = True) -> torch.Tensor:
    """Share of squared Frobenius norm that the top ``rank`` singular values of d [..., R, D] hold.

    ``reduce=True`` gives one fp32 scalar over all matrices (energy-weighted); otherwise one value per
    matrix. A matrix with no energy counts as fully captured.
    """
    s2 = torch.linalg.svdvals(d.float()).pow(2)
    kept, total = s2[..., :rank].sum(-1), s2.sum(-1)
    if reduce:
        kept, total = kept.sum(), total.sum()
    return torch.where(total > 0, kept / total.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(total))


def compose(deltas: list[LowRankDelta], rank: int | None = None) -> LowRankDelta:
    """One state equal to applying ``deltas`` one after another.

    Exact by default: rows are the sorted union and ranks concatenate (r = sum of r_i; B in fp32). With
    ``rank``, the summed deviation is recompressed by SVD instead, which caps the rank at a loss. States
    must not owe a shift (settle them with ``Realigner.settle`` first).
    """
    if not deltas:
        raise ValueError("compose needs at least one delta")
    first = deltas[0]
    rows = torch.cat([d.rows for d in deltas]).unique(sorted=True)
    where = [torch.searchsorted(rows, d.rows) for d in deltas]
    if rank is not None:
        _, heads, _, dim = first.key_basis().b.shape
        layers = first.num_layers
        dk = first.uk.new_zeros(layers, heads, rows.numel(), dim, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        for d, idx in zip(deltas, where):
            dk.index_add_(2, idx, d.key_coeffs().at() @ d.key_basis().at())
            dv.index_add_(2, idx, d.value_coeffs().at() @ d.value_basis().at())
        # a side's U that is not rows, and its 8-bit components when it has a 4-bit tail
        factored = first.value_coeffs() if first.rk is not None else first.key_coeffs()
        u8 = factored.rank - factored.tail if factored.tail else None
        fmt = Format(factored.u.dtype, int8_basis=first.sk is not None or first.sv is not None,
                     value_bits=first.value_coeffs().bits, key_bits=first.key_coeffs().bits, u8=u8,
                     head_bits=factored.head or 8)
        return compress(dk, dv, rows, rank, fmt, first_layer=min(d.first_layer for d in deltas))

    def scatter_u(us: list[torch.Tensor]) -> torch.Tensor:
        # Each delta's U gets its own rank columns; rows it does not correct stay zero.
        layers, heads = us[0].shape[:2]
        out = us[0].new_zeros(layers, heads, rows.numel(), sum(u.shape[-1] for u in us))
        col = 0
        for u, idx in zip(us, where):
            out[:, :, idx, col:col + u.shape[-1]] = u
            col += u.shape[-1]
        return out

    return LowRankDelta(rows, scatter_u([d.key_coeffs().at() for d in deltas]),
                        torch.cat([d.key_basis().at() for d in deltas], 2),
                        scatter_u([d.value_coeffs().at() for d in deltas]),
                        torch.cat([d.value_basis().at() for d in deltas], 2))


def apply_to(k_ref: torch.Tensor, v_ref: torch.Tensor, deltas: list[LowRankDelta],
             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize a corrected view: k_ref/v_ref [T, KVH, D] plus each delta's rows at ``layer`` (shift 0).

    Row sets may differ or overlap; overlapping corrections add. Meant as a test oracle and for small
    cases: attention over a view never needs this copy.
    """
    k, v = k_ref.clone(), v_ref.clone()
    for d in deltas:
        dk, dv = d.dense(layer)                       # [KVH, R, D]
        k.index_add_(0, d.rows, dk.transpose(0, 1).to(k.dtype))
        v.index_add_(0, d.rows, dv.transpose(0, 1).to(v.dtype))
    return k, v
