"""The compiled CPU loops of ``cpu_view.c``: decode-sized attention over a corrected view, fp32.

Built and loaded by ``cbuild.CLibrary`` (once per machine, on torch's OpenMP threads where it can):
``load`` returns the library, or None with the reason in ``unavailable()``, so callers can serve from
the torch path and say so; ``status`` says which. Plain tensors in, plain tensors out.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from .cbuild import CLibrary

SOURCE = Path(__file__).with_name("cpu_view.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_view_lowrank.c"), SOURCE.with_name("cpu_decode.c"))  # and cpu_view.h
MAX_RANK = 256              # the C loops read one U row into a stack buffer of this size,
MAX_ROWS = 64               # and blocks of rows' products with G * n <= MAX_ROWS query rows into others

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "vd_scores": [_I, _I, _I, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I],
    "vd_lowrank_scores": [_I, _I, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I],
    "vd_softmax_pv": [_I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _I],
    "vd_lowrank_values": [_I, _I, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _I],
    "vd_basis_queries": [_I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P],
    "vd_basis_values": [_I, _I, _I, _I, _I, _P, _I, _P, _P, _P],
    "vd_view_attention": [_I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P, _F, _I, _P, _P, _I],
    "vd_rope_write_attend": [_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _F, _P, _P, _I],
    "vd_rope_write_view": [_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P, _P, _F, _I, _P, _P, _P, _I],
    "vd_wide_loops": [],
}
_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}
LIB = CLibrary(SOURCES, _SIGNATURES, "KVCMAS_NO_CPU_KERNEL", "CPU view kernel")


def load() -> ctypes.CDLL | None:
    """The built library (building it on first use), or None when it cannot be built here."""
    return LIB.load()


def status(device: torch.device, dtype: torch.dtype) -> str:
    """What serves decode-sized attention on this device and cache dtype: "compiled" (these loops, built
    here on first use, on torch's threads), "compiled, one thread: <why>" or "torch: <why not>" on CPU;
    "" elsewhere."""
    if device.type != "cpu":
        return ""
    if dtype != torch.float32:
        return f"torch: the compiled loops are fp32, the cache is {str(dtype).replace('torch.', '')}"
    if load() is None:
        return f"torch: {unavailable()}"
    return f"compiled, one thread: {LIB.one_thread}" if LIB.one_thread else "compiled"


def wide() -> bool:
    """Whether scores and values of 64-wide heads run the AVX-512 loops (sixteen keys a sum, values'
    sums in registers) rather than the portable ones."""
    return LIB.flag("vd_wide_loops")


def threads() -> int:
    """How many threads the loops' parallel regions ask for: torch's, where they share its team."""
    return LIB.threads()


def unavailable() -> str | None:
    """Why ``load`` returned None (after it was called), else None."""
    return LIB.unavailable()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def scores(q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, key_class: torch.Tensor | None,
           q_cos: torch.Tensor | None, q_sin: torch.Tensor | None) -> torch.Tensor:
    """Scores [KVH, G*n, ctx] of q [n, H, D] over k_cache[slots] [ctx, KVH, D], each key scored by the
    query moved by minus its class's delta (tables [C, D] in rotate-half form) when key_class is given."""
    n, heads, dim = q.shape
    kvh, ctx = k_cache.shape[1], slots.numel()
    g = heads // kvh
    classes = 0 if key_class is None else q_cos.shape[0]
    qr = q.new_empty(max(classes, 1), kvh, g * n, dim)
    out = q.new_empty(kvh, g * n, ctx)
    load().vd_scores(n, kvh, g, dim, _ptr(q), _ptr(k_cache), ctx, _ptr(slots), _ptr(key_class), classes,
                     _ptr(q_cos), _ptr(q_sin), _ptr(qr), _ptr(out), threads())
    return out


@dataclass
class Coeffs:
    """A stack's U for the loops, transposed: ``u`` [KVH, r, R] fp32, or int8 codes times optional row
    scales [KVH, R] and channel scales (a table [KVH, S, r] and each row's entry [R] int32 in it). All
    contiguous."""

    u: torch.Tensor
    scale: torch.Tensor | None = None
    channels: torch.Tensor | None = None
    row_state: torch.Tensor | None = None

    def args(self) -> tuple:
        fp = self.u.dtype == torch.float32
        return (self.u.shape[1], _ptr(self.u) if fp else None, None if fp else _ptr(self.u), _ptr(self.scale),
                _ptr(self.channels), _ptr(self.row_state), 0 if self.channels is None else self.channels.shape[1])


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the loops can serve q [n, H, D] over this cache: CPU, fp32, sizes within their buffers,
    and built here."""
    return usable_rows(q.shape[0], q.shape[1], q.shape[-1], q, k_cache)


def usable_rows(n: int, heads: int, dim: int, like: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """``usable`` for n queries of ``heads`` heads of ``dim``, on ``like``'s device and dtype."""
    return (like.device.type == "cpu" and like.dtype == k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and dim <= MAX_RANK and heads // k_cache.shape[1] * n <= MAX_ROWS and load() is not None)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of the last n positions q [n, H, D] over k/v_cache[slots], read in place; the
    output [KVH, G*n, D] with row g*n + i for query i of group head g."""
    return softmax_pv(q.shape[0], scores(q.contiguous(), k_cache, slots, None, None, None), scale, v_cache, slots)


def lowrank_scores(scores_: torch.Tensor, rows: torch.Tensor, group: torch.Tensor, qb: torch.Tensor,
                   u: Coeffs) -> None:
    """scores[h, :, rows[j]] += qb[group[j], h] . U[h, j] in place."""
    kvh, gn, ctx = scores_.shape
    r, *rest = u.args()
    load().vd_lowrank_scores(kvh, gn, ctx, _ptr(scores_), rows.numel(), _ptr(rows), _ptr(group), r, _ptr(qb), *rest,
                             threads())


def softmax_pv(n: int, scores_: torch.Tensor, scale: float, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Turns scores into causal probabilities in place and returns probs . v_cache[slots] [KVH, G*n, D]."""
    kvh, gn, ctx = scores_.shape
    out = scores_.new_empty(kvh, gn, v_cache.shape[-1])
    load().vd_softmax_pv(n, kvh, gn, v_cache.shape[-1], ctx, scale, _ptr(scores_), _ptr(v_cache), _ptr(slots),
                         _ptr(out), threads())
    return out


def lowrank_values(probs: torch.Tensor, rows: torch.Tensor, group: torch.Tensor, groups: int, u: Coeffs
                   ) -> torch.Tensor:
    """pu [groups, KVH, G*n, r]: each group's sum over its rows of probs[h, :, rows[j]] * U[h, j]."""
    kvh, gn, ctx = probs.shape
    args = u.args()
    pu = probs.new_zeros(groups, kvh, gn, args[0])
    load().vd_lowrank_values(kvh, gn, ctx, _ptr(probs), rows.numel(), _ptr(rows), _ptr(group), *args, _ptr(pu),
                             threads())
    return pu


@dataclass
class Bases:
    """A stack's bases of one layer for the loops: per group B [KVH, r, D] (fp32, int8 or bf16, all alike;
    None for the identity), optional fp32 component scales [KVH, r] and optional rotate-half tables [D]
    of its D axis. Holds the tensors it points at."""

    b: list[torch.Tensor | None]
    scale: list[torch.Tensor | None]
    cos: list[torch.Tensor | None]
    sin: list[torch.Tensor | None]

    def __post_init__(self) -> None:
        first = self.b[0]
        self.kind = 3 if first is None else _KINDS[first.dtype]
        self.rank = None if first is None else first.shape[1]
        addr = lambda ts: torch.tensor([0 if t is None else t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
        self._b, self._scale, self._cos, self._sin = addr(self.b), addr(self.scale), addr(self.cos), addr(self.sin)

    @staticmethod
    def supports(b: torch.Tensor | None) -> bool:
        return b is None or (b.dtype in _KINDS and b.is_contiguous())


def basis_queries(qg: torch.Tensor, bases: Bases) -> torch.Tensor:
    """qb [NB, KVH, G*n, r] = qg [KVH, G*n, D] . B_i^T for each group's basis."""
    kvh, gn, d = qg.shape
    r = d if bases.rank is None else bases.rank
    qb = qg.new_empty(len(bases.b), kvh, gn, r)
    qg = qg.contiguous()              # held here while the loops read it
    load().vd_basis_queries(len(bases.b), kvh, gn, r, d, _ptr(qg), bases.kind, _ptr(bases._b),
                            _ptr(bases._scale), _ptr(bases._cos), _ptr(bases._sin), _ptr(qb))
    return qb


def basis_values(pu: torch.Tensor, bases: Bases, out: torch.Tensor) -> None:
    """out [KVH, G*n, D] += sum over groups of pu[i] [KVH, G*n, r] . B_i, in place."""
    nb, kvh, gn, r = pu.shape
    load().vd_basis_values(nb, kvh, gn, r, out.shape[-1], _ptr(pu), bases.kind, _ptr(bases._b), _ptr(bases._scale),
                           _ptr(out))


def stack_table(rows: torch.Tensor, group: torch.Tensor, groups: int, keys: Coeffs, key_bases: Bases,
                values: Coeffs, value_bases: Bases) -> torch.Tensor:
    """One stack of a layer's view packed for ``view_attention`` (the C side's S_* fields): addresses of
    tensors the caller keeps alive (rows [R] int64, group [R] int32, both sides' U and bases)."""
    def side(u: Coeffs, b: Bases, rotated: bool) -> list[int]:
        r, uf, u8, scale, chan, state, states = u.args()
        tables = [b._cos.data_ptr(), b._sin.data_ptr()] if rotated else []
        return [r, uf or 0, u8 or 0, scale or 0, chan or 0, state or 0, states, b.kind, b._b.data_ptr(),
                b._scale.data_ptr(), *tables]
    return torch.tensor([rows.numel(), rows.data_ptr(), group.data_ptr(), groups,
                         *side(keys, key_bases, True), *side(values, value_bases, False)], dtype=torch.int64)


def joined_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    """Stacks' tables (``stack_table``) as one [nst * fields] table for the C side."""
    if len(tables) == 1:
        return tables[0]
    return torch.cat(tables) if tables else torch.zeros(1, dtype=torch.int64)


def view_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   key_class: torch.Tensor | None, q_cos: torch.Tensor | None, q_sin: torch.Tensor | None,
                   scale: float, tables: list[torch.Tensor]) -> torch.Tensor:
    """A decode step's attention over a corrected view for one layer in one call: q [n, H, D] over
    k/v_cache[slots], keys realigned by class (as ``scores``), plus each stack's low-rank terms
    (``stack_table``); the output [KVH, G*n, D] (as ``attention``)."""
    n, heads, dim = q.shape
    kvh, ctx = k_cache.shape[1], slots.numel()
    classes = 0 if key_class is None else q_cos.shape[0]
    table = joined_tables(tables)
    out = q.new_empty(kvh, heads // kvh * n, dim)
    load().vd_view_attention(n, kvh, heads // kvh, dim, _ptr(q), _ptr(k_cache), _ptr(v_cache), ctx, _ptr(slots),
                             _ptr(key_class), classes, _ptr(q_cos), _ptr(q_sin), scale, len(tables), _ptr(table),
                             _ptr(out), threads())
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, write_slots: torch.Tensor, heads: int, slots: torch.Tensor | None = None,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's start of attention in one call: the fused q/k/v product's rows ``qkv`` [n, (H + 2
    KVH) * D] rotated in place (cos and signed sin [n, 1, D], bitwise ``rope.rotate_``), k and v written
    to the caches at ``write_slots``; returns q [n, H, D] and, given the context's ``slots``, its plain
    attention over them [KVH, G*n, D] (as ``attention``), else None."""
    n, kvh, dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[2]
    q = qkv.new_empty(n, heads, dim)
    out = None if slots is None else qkv.new_empty(kvh, heads // kvh * n, dim)
    load().vd_rope_write_attend(n, heads, kvh, dim, _ptr(qkv), _ptr(cos), _ptr(sin_signed), _ptr(k_cache),
                                _ptr(v_cache), _ptr(write_slots), 0 if slots is None else slots.numel(), _ptr(slots),
                                scale, _ptr(q), _ptr(out), threads())
    return q, out


def rope_write_view(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, write_slots: torch.Tensor, heads: int, call: tuple, scale: float
                    ) -> torch.Tensor:
    """``rope_write``, then the step's attention over a corrected view as ``view_attention`` computes it,
    in the same call; ``call`` is (slots, key_class, q_cos, q_sin, tables, held) as
    ``reuse.views.compiled.one_call`` gives it. The output [KVH, G*n, D]."""
    n, kvh, dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[2]
    slots, key_class, q_cos, q_sin, tables, _ = call
    table, stacks = joined_tables(tables), len(tables)
    q = qkv.new_empty(n, heads, dim)
    out = qkv.new_empty(kvh, heads // kvh * n, dim)
    classes = 0 if key_class is None else q_cos.shape[0]
    load().vd_rope_write_view(n, heads, kvh, dim, _ptr(qkv), _ptr(cos), _ptr(sin_signed), _ptr(k_cache),
                              _ptr(v_cache), _ptr(write_slots), slots.numel(), _ptr(slots), _ptr(key_class), classes,
                              _ptr(q_cos), _ptr(q_sin), scale, stacks, _ptr(table), _ptr(q), _ptr(out), threads())
    return out


def rope_write_usable(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, write_slots: torch.Tensor) -> bool:
    """Whether ``rope_write`` serves these rows: CPU fp32 contiguous rows, one write slot (int64) a row,
    a cache of the same dtype, and the library built here."""
    return (qkv.device.type == "cpu" and qkv.dtype == k_cache.dtype == cos.dtype == torch.float32
            and qkv.is_contiguous() and cos.is_contiguous() and k_cache.is_contiguous()
            and write_slots.dtype == torch.int64 and write_slots.numel() == qkv.shape[0]
            and write_slots.is_contiguous() and k_cache.shape[-1] <= MAX_RANK and load() is not None)
