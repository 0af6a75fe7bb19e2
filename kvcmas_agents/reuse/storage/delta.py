"""A correction state (``LowRankDelta``): a segment's corrected rows as quantized rows or a truncated SVD.

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
Readers get U through ``Coeffs`` and B through ``Basis`` (``storage.readers``), which dequantize
them and, for keys, apply the state's pending position ``shift``. A state may leave out its leading
layers (``first_layer``): readers then get zeros there.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import torch

from .quant_rows import code_bits, row_width
from .readers import Basis, Coeffs, plain_rank


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
