"""StorageSpec: how KVCMAS stores its corrections. The one place their defaults are written."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import HEAD_BITS, Format
from .quant_rows import BITS as ROW_BITS

FACTOR_DTYPES: tuple[str, ...] = ("int8_basis", "int8", "bfloat16", "float16", "float32", "kv")
SIDE_BITS: tuple[int, ...] = (0, *ROW_BITS)        # 0: factored; else the bits of quantized rows
BASES: tuple[str, ...] = ("request", "segment")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class StorageSpec:
    """Storage of KVCMAS corrections (docs/storage.md has what each choice costs and saves).

    dtype: the factors' storage: "int8_basis" (U as codes with per-component scales folded into B, B in
        int8 with one fp32 scale per component), "int8" (B in bf16), "bfloat16", "float16", "float32",
        or "kv" (the KV cache's dtype). A recompute ratio of 1.0 keeps the exact deviation whatever this says.
    u_head_bits: with int8 factors, code bits of U's leading components: 6 (four codes in three bytes) or 8.
    u8_components: with int8 factors, how many of U's leading components keep u_head_bits codes; the
        rest, which the SVD orders smallest, get 4-bit codes (None: none do).
    value_bits / key_bits: 0 factors that side; 4, 6 or 8 keeps it full rank as rows quantized per row
        (keys after one scale per channel).
    small_rows: with int8 factors, a side whose factors would take more bytes than its rows as 8-bit
        rows keeps those rows instead, in small_row_bits (6 or 8).
    uncorrected_energy: a request stores no correction for its leading layers while they hold at most
        this share of its keys' and of its values' squared deviation (layer 0 is never stored).
    correction_energy: share of a request's squared deviation its stored rows keep, strongest rows
        first (1.0 keeps every recomputed row).
    basis: "request" compresses all segments one request corrects against one shared basis per layer
        and KV head; "segment" gives each segment its own.
    """

    dtype: str = "int8_basis"
    u_head_bits: int = 6
    u8_components: int | None = 28
    value_bits: int = 0
    key_bits: int = 0
    small_rows: bool = True
    small_row_bits: int = 6
    uncorrected_energy: float = 0.01
    correction_energy: float = 1.0
    basis: str = "request"

    def __post_init__(self) -> None:
        if self.dtype not in FACTOR_DTYPES:
            raise ValueError(f"storage dtype must be one of {FACTOR_DTYPES}, got {self.dtype!r}")
        if self.u_head_bits not in HEAD_BITS or not _is_int(self.u_head_bits):
            raise ValueError(f"u_head_bits must be one of {HEAD_BITS}, got {self.u_head_bits!r}")
        if self.u8_components is not None and (not _is_int(self.u8_components) or self.u8_components < 0):
            raise ValueError(f"u8_components must be None or an int >= 0, got {self.u8_components!r}")
        for name in ("value_bits", "key_bits"):
            bits = getattr(self, name)
            if bits not in SIDE_BITS or not _is_int(bits):
                raise ValueError(f"{name} must be one of {SIDE_BITS}, got {bits!r}")
        if not isinstance(self.small_rows, bool):
            raise ValueError(f"small_rows must be a bool, got {self.small_rows!r}")
        if self.small_row_bits not in ROW_BITS or not _is_int(self.small_row_bits):
            raise ValueError(f"small_row_bits must be one of {ROW_BITS}, got {self.small_row_bits!r}")
        if not 0.0 <= self.uncorrected_energy < 1.0:
            raise ValueError(f"uncorrected_energy must be in [0, 1), got {self.uncorrected_energy}")
        if not 0.0 < self.correction_energy <= 1.0:
            raise ValueError(f"correction_energy must be in (0, 1], got {self.correction_energy}")
        if self.basis not in BASES:
            raise ValueError(f"basis must be one of {BASES}, got {self.basis!r}")

    @property
    def joint_basis(self) -> bool:
        return self.basis == "request"

    def format(self) -> Format:
        """The codec switches of ``codec.compress`` for this storage."""
        dtype = None if self.dtype == "kv" else getattr(torch, self.dtype.removesuffix("_basis"))
        return Format(dtype, int8_basis=self.dtype == "int8_basis", value_bits=self.value_bits,
                      key_bits=self.key_bits, small_rows=self.small_rows, u8=self.u8_components,
                      small_bits=self.small_row_bits, head_bits=self.u_head_bits)
