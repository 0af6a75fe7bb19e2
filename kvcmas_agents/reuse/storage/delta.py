"""A correction state (``LowRankDelta``): a segment's corrected rows as quantized rows or a truncated SVD.

For one segment, the corrected view is ``K_ref + scatter(rows, U_k @ B_k)`` per layer and KV head
(likewise for V), with ``U`` [L, KVH, R, r] and ``B`` [L, KVH, r, D]. Each side (K, V) is a
``DeltaSide``:
- low rank: a rank-r truncated SVD, singular values folded into U; an int8 U's per-component scales
  fold into B, and an int8 B (``int8_basis``) carries one fp32 scale per component (``basis_scale``).
  With ``u8`` only U's leading ``u8`` components keep 8-bit codes: the trailing ones, which hold the
  least of the deviation, are 4-bit codes packed two to a byte at the end of U (``tail4`` counts
  them). With ``head_bits=6`` the leading ones are 6-bit codes instead, four packed in three bytes; or
- full rank (``compress(value_bits=...)`` for the values, ``key_bits=...`` for the keys, and with
  ``small_rows`` any int8 side whose factors would be larger, as ``small_bits`` rows): U is the
  deviation rows themselves, quantized per row to 4, 6 or 8 bits with one bf16 scale per row and head
  (``row_scale``), key rows after dividing by one bf16 scale per channel (``channel_scale``), and B is
  the identity (not stored).
Readers get U through ``Coeffs`` and B through ``Basis`` (``storage.readers``), which dequantize
them and, for keys, apply the state's pending position ``shift``. A state may leave out its leading
layers (``first_layer``): readers then get zeros there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterable

import torch

from .quant_rows import code_bits, row_width
from .readers import Basis, Coeffs, plain_rank


@dataclass(frozen=True, eq=False)
class DeltaSide:
    """One side (keys or values) of a correction state: U, B and how they are stored.

    Frozen, compared by identity: the states of a joint basis, and a state moved by
    ``Realigner.rotate_delta``, share sides or their tensors. Every tensor holds the state's stored
    layers only (``LowRankDelta.first_layer``).
    """

    u: torch.Tensor                              # [L, KVH, R, r]: coefficients, or quantized rows
    b: torch.Tensor | None = None                # [L, KVH, r, D]; None: identity (quantized rows)
    basis_scale: torch.Tensor | None = None      # [L, KVH, r, 1]: per-component scales of an int8 B
    row_scale: torch.Tensor | None = None        # [L, KVH, R, 1]: a full-rank side's per-row scales
    channel_scale: torch.Tensor | None = None    # [L, KVH, 1, D]: optional per-channel scales of such rows
    tail4: int = 0              # an int8 U's trailing components as 4-bit codes, two a byte in its last columns
    row_bits: int = 0           # bits of quantized rows (given 0 with row_scale: what the codes' dtype says)
    head_bits: int = 0          # bits of an int8 U's leading (not 4-bit) components: 0 or 8, or 6 (pack_sixes)

    def __post_init__(self) -> None:
        u, b, r, c, t, h = self.u, self.b, self.row_scale, self.channel_scale, self.tail4, self.head_bits
        if r is None and self.row_bits:
            raise ValueError(f"row_bits={self.row_bits}: only quantized rows (with row scales) have code bits")
        if r is not None:
            object.__setattr__(self, "row_bits", code_bits(u, self.row_bits))
        if u.dim() != 4:
            raise ValueError(f"a U factor is [L, KVH, R, r], got {tuple(u.shape)}")
        layers, heads = u.shape[:2]
        if r is None and (u.dtype == torch.uint8 or b is None):
            raise ValueError("a low-rank state needs B factors (only quantized rows with row scales have none)")
        if r is not None and (u.dtype not in (torch.int8, torch.uint8) or r.shape != (*u.shape[:3], 1)):
            raise ValueError("quantized rows are int8 or uint8 (4- or 6-bit) with row scales [L, KVH, R, 1]")
        if t and (t < 0 or t % 2 or r is not None or u.dtype != torch.int8 or t // 2 > u.shape[3]):
            raise ValueError(f"4-bit components come in pairs at the end of an int8 U factor, got {t}")
        if h not in (0, 6, 8) or (h == 6 and (r is not None or u.dtype != torch.int8 or (u.shape[3] - t // 2) % 3)):
            raise ValueError(f"an int8 U's leading components have 8- or 6-bit codes (6: in columns of "
                             f"three bytes per four), got {h} bits over {u.shape[3] - t // 2} columns")
        if c is not None and (r is None or c.shape != (layers, heads, 1, self.rank)):
            raise ValueError("channel scales [L, KVH, 1, D] belong to quantized rows only")
        if b is None:
            if self.basis_scale is not None:
                raise ValueError("an identity basis has no scales")
            return
        if b.shape[:3] != (layers, heads, self.rank):
            raise ValueError("U and B factors disagree on rank or layout")
        s = self.basis_scale
        if (s is None) != (b.dtype != torch.int8) or (s is not None and s.shape != (*b.shape[:3], 1)):
            raise ValueError("int8 B factors need scales [L, KVH, r, 1], and only they have scales")

    @property
    def rank(self) -> int:
        """Components of U (the row width D for quantized rows)."""
        if self.row_scale is not None:
            return row_width(self.u, self.row_bits)
        return plain_rank(self.u.shape[3], self.tail4, self.head_bits)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The row-indexed tensors (U and its row scales): each state's own."""
        return tuple(t for t in (self.u, self.row_scale) if t is not None)

    def basis_tensors(self) -> tuple[torch.Tensor, ...]:
        """B, its scales and the rows' channel scales: what the states of a joint basis share."""
        return tuple(t for t in (self.b, self.basis_scale, self.channel_scale) if t is not None)

    def coeffs(self, first_layer: int) -> Coeffs:
        """U as readers need it (dequantized when read)."""
        return Coeffs(self.u, self.row_scale, self.channel_scale, first_layer, self.tail4, self.row_bits,
                      self.head_bits)

    def basis(self, first_layer: int, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> Basis:
        """B as readers need it, rotated by ``cos_sin`` if given; the identity for quantized rows."""
        b = self.b if self.b is not None else _eye(*self.u.shape[:2], self.rank, self.u.device)
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        return Basis(b, self.basis_scale, cos, sin, identity=self.b is None, first=first_layer)

    def take_rows(self, start: int, stop: int) -> "DeltaSide":
        """This side for rows [start, stop): own copies of the row-indexed tensors (not views, so each
        part's bytes are its own), the basis shared."""
        cut = lambda t: None if t is None else t[:, :, start:stop].clone()  # noqa: E731
        return replace(self, u=cut(self.u), row_scale=cut(self.row_scale))

    def to(self, device: torch.device | str) -> "DeltaSide":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, u=move(self.u), b=move(self.b), basis_scale=move(self.basis_scale),
                       row_scale=move(self.row_scale), channel_scale=move(self.channel_scale))


@dataclass
class LowRankDelta:
    """Deviation of ``rows`` of a segment, per layer and KV head: K rows += k.u @ k.b, V rows += v.u @ v.b.

    Key factors live in the positional frame of the view they were computed in; ``shift`` is the
    rotation (in positions) still owed to the key basis to move them into the view they now correct
    (see ``Realigner.rotate_delta``), applied when read, so a moved state shares its tensors instead
    of holding a rotated copy. The sides hold layers [first_layer, first_layer + L); the layers before
    correct nothing and store nothing (layer 0's deviation is rounding: see ``Corrector``).
    """

    rows: torch.Tensor          # LongTensor [R], unique indices into the segment's tokens
    k: DeltaSide
    v: DeltaSide
    shift: int = 0
    first_layer: int = 0

    def __post_init__(self) -> None:
        if self.first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {self.first_layer}")
        layers, heads, nrows, _ = self.k.u.shape
        if self.rows.shape != (nrows,) or self.v.u.shape[:3] != (layers, heads, nrows):
            raise ValueError(f"rows {tuple(self.rows.shape)} do not match factors {tuple(self.k.u.shape)}")

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "LowRankDelta":
        """A state that corrects nothing (R = 0, r = 0)."""
        u = torch.zeros(num_layers, kv_heads, 0, 0, dtype=dtype, device=device)
        b = torch.zeros(num_layers, kv_heads, 0, head_dim, dtype=dtype, device=device)
        return cls(torch.zeros(0, dtype=torch.long, device=device), DeltaSide(u, b), DeltaSide(u.clone(), b.clone()))

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def num_layers(self) -> int:
        """Layers the state spans, the uncorrected leading ones included."""
        return self.first_layer + self.k.u.shape[0]

    @property
    def rank(self) -> int:
        """Largest of the key and value ranks (head_dim for full-rank rows)."""
        return max(self.k.rank, self.v.rank)

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the state's tensors, rows and scales included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rows,) + self.k.tensors() + self.v.tensors() + self.basis_tensors()

    def basis_tensors(self) -> tuple[torch.Tensor, ...]:
        """The B factors and their scales, and the rows' channel scales (what a joint basis shares)."""
        return self.k.basis_tensors() + self.v.basis_tensors()

    def key_coeffs(self) -> Coeffs:
        """U_k as readers need it (dequantized when read)."""
        return self.k.coeffs(self.first_layer)

    def value_coeffs(self) -> Coeffs:
        return self.v.coeffs(self.first_layer)

    def key_basis(self, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> Basis:
        """B_k as readers need it; ``cos_sin`` rotates it by ``shift`` (``Realigner.key_basis`` passes it)."""
        if self.shift and cos_sin is None:
            raise ValueError(f"this state's keys still owe a rotation by {self.shift}: read them through "
                             "Realigner.key_basis")
        return self.k.basis(self.first_layer, cos_sin if self.shift else None)

    def value_basis(self) -> Basis:
        return self.v.basis(self.first_layer)

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed deviations (dk, dv), each [KVH, R, D] in fp32, for one layer (shift 0 only)."""
        return (self.key_coeffs().at(layer) @ self.key_basis().at(layer),
                self.value_coeffs().at(layer) @ self.value_basis().at(layer))

    def to(self, device: torch.device | str) -> "LowRankDelta":
        return replace(self, rows=self.rows.to(device), k=self.k.to(device), v=self.v.to(device))


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
