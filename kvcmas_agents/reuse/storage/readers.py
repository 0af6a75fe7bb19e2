"""Readers of a correction state's stored factors: ``Coeffs`` (U), ``Basis`` (B) and ``KeptCodes``.

They dequantize what a ``LowRankDelta`` stores (int8 codes, packed 6- and 4-bit codes, quantized rows
with their row and channel scales), apply a key basis's pending rotation, read the layers a state leaves
out as zeros, and read several states of a view together (one op per layer for all of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...model.rope import rotate
from .code_features import features
from .quant_rows import code_bits, dequantize_rows, row_width, unpack_nibbles, unpack_sixes


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
