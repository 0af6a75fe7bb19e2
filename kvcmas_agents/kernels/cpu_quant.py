"""The compiled CPU products of ``cpu_quant.c``: fp32 rows times weights in GGUF's Q4_1 / Q8_0 blocks.

Built and loaded by ``cbuild.CLibrary`` like the view loops; ``load`` returns None with the reason in
``unavailable()`` where it cannot build, and the model then keeps its dense weights. Plain tensors in,
plain tensors out.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cbuild import CLibrary

SOURCE = Path(__file__).with_name("cpu_quant.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_quant_int8.c"))     # and cpu_quant.h beside them
BLOCK = 32                   # weights per block (both formats)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {"kq_matmul": [_I, _I, _I, _P, _P, _F, _P, _P, _P, _I, _I, _P, _I],
               "kq_layer_tail": [_I, _I, _I, _I, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I]}
LIB = CLibrary(SOURCES, _SIGNATURES, "KVCMAS_NO_CPU_KERNEL", "CPU block kernel")


def load() -> ctypes.CDLL | None:
    """The built library (building it on first use), or None when it cannot be built here."""
    return LIB.load()


def unavailable() -> str | None:
    """Why ``load`` returned None (after it was called), else None."""
    return LIB.unavailable()


def vectorized() -> bool:
    """Whether the library was built with its AVX-512 path (else the portable C loops)."""
    return LIB.flag("kq_vectorized")


def int8_vectorized() -> bool:
    """Whether the int8 rows' products run on AVX-512 VNNI (else portable loops: no faster than fp32 rows)."""
    return LIB.flag("kq_int8_vectorized")


def matmul(x: torch.Tensor, weight: tuple[int, int, int | None], features: int, norm: torch.Tensor | None = None,
           eps: float = 0.0, glu: bool = False, int8: bool = False) -> torch.Tensor:
    """x [M, K] fp32 @ w.T for w [N = features, K] in blocks, given as the data pointers of its tensors
    (qs, d, m): Q4_1 (qs [N, K/2] uint8, d and m [N, K/32] fp16) or Q8_0 (qs [N, K] int8, d [N, K/32]
    fp16, m None); the caller keeps them alive. ``norm`` [K]: RMS-normalize x's rows (with eps) and
    scale them by it first; ``glu``: w is gate then up, and the result [M, N/2] is silu(gate) * up;
    ``int8``: quantize x's rows to int8 a block of 32 and sum in integers, as llama.cpp does (K a
    multiple of 64, else fp32 rows)."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], features // 2 if glu else features)
    qs, d, m = weight
    load().kq_matmul(x.shape[0], features, x.shape[1], x.data_ptr(), None if norm is None else norm.data_ptr(),
                     eps, qs, d, m, glu, int8, out.data_ptr(), LIB.threads())
    return out


def layer_tail(h: torch.Tensor, attn: torch.Tensor, norm: torch.Tensor, eps: float, o: tuple, gate_up: tuple,
               down: tuple, intermediate: int, int8: bool = False) -> torch.Tensor:
    """A layer after attention in one call: out = h + o . attn, then out + down . (silu(gate) * up) of
    out RMS-normalized by ``norm``. h [M, K], attn [M, A] fp32; each weight as ``matmul``'s pointers,
    ``int8`` as there."""
    h, attn = h.contiguous(), attn.contiguous()
    out = torch.empty_like(h)
    load().kq_layer_tail(h.shape[0], h.shape[1], attn.shape[1], intermediate, h.data_ptr(), attn.data_ptr(),
                         norm.data_ptr(), eps, *o, *gate_up, *down, int8, out.data_ptr(), LIB.threads())
    return out
