"""Triton flash attention over a corrected KV view, read in place from the paged store.

Same math as ``kvcmas_agents.reuse.views.reference`` (the oracle), fused into one online-softmax
pass over key tiles:

* Keys and values are read through a slot index (``key_slots``), so a view is any list of store rows;
  padding slots are -1 and never read.
* Each key tile belongs to one *run* of the view (a reused segment, or own/exact rows). The run's
  realignment is applied to the query, in registers: the tile's queries are ``R(-delta) q``, from the
  run's row of the ``cos``/``sin`` tables (row 0 is the identity), so home keys are used as stored.
* A run carries a chain of low-rank corrections. For chain level ``l`` a key's row in the stacked
  ``uk``/``uv`` factors is ``key_urow[l, key]`` (-1: not corrected at that level).
  - Scores add ``(q . B_k^T) . U_k^T``. ``q . B_k^T`` is a small pre-pass per layer (one torch
    einsum, [corrections, KVH, Tq * G, rank]); the kernel then adds ``qb . U_k[rows]^T`` per tile.
  - Values add ``(P[:, rows] . U_v) . B_v`` per tile, with the tile's P already scaled to the running
    maximum, straight into the output accumulator (rows outside the correction have zero U rows).
* Causality is by logical position: key ``j`` is visible to query ``t`` iff ``key_pos[j] <= q_pos[t]``.
  Per row block, tiles past the last visible one are skipped.
* GQA: one program handles one KV head and a block of (query, group head) rows.
* Decode (few rows) may split the key tiles over several programs; their partial softmaxes are merged
  by log-sum-exp in torch.

Accumulators are fp32. With bf16/fp16 inputs on a GPU the dots take low-precision operands (tensor
cores); with fp32 inputs, or under ``TRITON_INTERPRET=1`` (whose bf16 arithmetic is unreliable), they
run in fp32. Only small per-step metadata and the pre-pass live outside the kernel: no per-agent view.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import interpreting

PAD_POS = 2**31 - 1          # logical position of padding keys: visible to no query


@dataclass
class ViewDescriptor:
    """A view flattened for the kernel; one descriptor serves every layer of one step.

    N = number of key tiles * ``block_n``; C = longest correction chain; NC = corrections;
    Rt = corrected rows over all corrections; RP = rank padded to >= 16.
    """

    key_slots: torch.Tensor    # [N] int32 store slot of each key, -1 for padding
    key_pos: torch.Tensor      # [N] int32 logical position, PAD_POS for padding
    tile_rot: torch.Tensor     # [T] int32 row of cos/sin applied to the tile's queries
    tile_corr: torch.Tensor    # [T] int32 index of the tile's first correction
    tile_ncorr: torch.Tensor   # [T] int32 chain length of the tile's run
    cos: torch.Tensor          # [NR, D] fp32 pure rotation by -delta (rotate-half layout)
    sin: torch.Tensor          # [NR, D] fp32
    key_urow: torch.Tensor     # [C, N] int32 row of each key in uk/uv per chain level, -1 if none
    uk: torch.Tensor           # [L, KVH, Rt, RP] key U factors, zero-padded in rank
    bk: torch.Tensor           # [NC, L, KVH, RP, D] key B factors
    uv: torch.Tensor           # [L, KVH, Rt, RP]
    bv: torch.Tensor           # [NC, L, KVH, RP, D]
    block_n: int
    tile_min_pos: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.tile_min_pos = self.key_pos.view(-1, self.block_n).amin(1)

    @property
    def num_tiles(self) -> int:
        return self.tile_rot.numel()

    @property
    def num_corrections(self) -> int:
        return self.bk.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the descriptor's own tensors (per-step metadata plus stacked factors)."""
        ts = (self.key_slots, self.key_pos, self.tile_rot, self.tile_corr, self.tile_ncorr, self.cos,
              self.sin, self.key_urow, self.uk, self.bk, self.uv, self.bv, self.tile_min_pos)
        return sum(t.numel() * t.element_size() for t in ts)


@triton.jit
def _mm(a, b, dt, LOWP: tl.constexpr):
    """a @ b with fp32 accumulation; low-precision operands on tensor cores when LOWP."""
    if LOWP:
        return tl.dot(a.to(dt), b.to(dt))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _view_attn_kernel(
        q_ptr, qpos_ptr, o_ptr, m_ptr, l_ptr, k_ptr, v_ptr,
        slot_ptr, kpos_ptr, ntiles_ptr, trot_ptr, tcorr_ptr, tncorr_ptr, cos_ptr, sin_ptr,
        urow_ptr, qb_ptr, uk_ptr, uv_ptr, bv_ptr,
        stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ms, stride_mt,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_ul, stride_qbc, stride_qbh, stride_uh, stride_ur, stride_bc, stride_bh, stride_br,
        n_rows, tiles_per_split, scale_log2,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CORR: tl.constexpr, SPLIT: tl.constexpr,
        LOWP: tl.constexpr):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    dt = k_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    t = offs_m // G
    head = kvh * G + offs_m % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qmask = row_ok[:, None] & d_ok[None, :]
    q_rows = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh
    # rotate_half(q) = [-q2, q1]: the same row read with its halves swapped. Both stay in the input
    # dtype on GPU (exact, and half the registers); the rotation itself runs in fp32 per tile.
    q_a = tl.load(q_rows + offs_d[None, :], mask=qmask, other=0.0)
    q_b = tl.load(q_rows + ((offs_d + HALF) % D)[None, :], mask=qmask, other=0.0)
    if not LOWP:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
    q_b = tl.where((offs_d < HALF)[None, :], -q_b, q_b)
    q_pos = tl.load(qpos_ptr + t, mask=row_ok, other=-1)
    offs_r = tl.arange(0, RP)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)    # finite: rows that see no key stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * tiles_per_split
    hi = tl.minimum(tl.load(ntiles_ptr + pid_m), lo + tiles_per_split)
    for tile in range(lo, hi):
        rot = tl.load(trot_ptr + tile)
        cos = tl.load(cos_ptr + rot * D + offs_d, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + rot * D + offs_d, mask=d_ok, other=0.0)
        q_r = q_a.to(tl.float32) * cos[None, :] + q_b.to(tl.float32) * sin[None, :]   # R(-delta) q

        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ptr + offs_n)          # int32 offsets: half the address registers of int64
        k_pos = tl.load(kpos_ptr + offs_n)
        kvmask = (slot >= 0)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kvmask, other=0.0)
        s = _mm(q_r, tl.trans(k), dt, LOWP)
        if HAS_CORR:
            c0 = tl.load(tcorr_ptr + tile)
            n_corr = tl.load(tncorr_ptr + tile)
            for level in range(0, n_corr):                             # (q . B_k^T) . U_k^T
                urow = tl.load(urow_ptr + level * stride_ul + offs_n)
                u_k = tl.load(uk_ptr + kvh * stride_uh + urow[:, None] * stride_ur + offs_r[None, :],
                              mask=(urow >= 0)[:, None], other=0.0)
                qb = tl.load(qb_ptr + (c0 + level) * stride_qbc + kvh * stride_qbh + offs_m[:, None] * RP
                             + offs_r[None, :], mask=row_ok[:, None], other=0.0)
                s += _mm(qb, tl.trans(u_k), dt, LOWP)
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _mm(p, v, dt, LOWP)
        if HAS_CORR:
            for level in range(0, n_corr):                             # (P[:, rows] . U_v) . B_v
                urow = tl.load(urow_ptr + level * stride_ul + offs_n)
                u_v = tl.load(uv_ptr + kvh * stride_uh + urow[:, None] * stride_ur + offs_r[None, :],
                              mask=(urow >= 0)[:, None], other=0.0)
                b_v = tl.load(bv_ptr + (c0 + level) * stride_bc + kvh * stride_bh + offs_r[:, None] * stride_br
                              + offs_d[None, :], mask=d_ok[None, :], other=0.0)
                acc += _mm(_mm(p, u_v, dt, LOWP), b_v, dt, LOWP)
        m_i = m_new

    o_off = split * stride_os + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:      # unnormalized partials, merged by log-sum-exp outside
        tl.store(o_ptr + o_off, acc, mask=qmask)
        ml_off = split * stride_ms + t * stride_mt + head
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    else:
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qmask)


def _row_block_tiles(q_pos: torch.Tensor, group: int, block_m: int, desc: ViewDescriptor) -> torch.Tensor:
    """Per row block, 1 + the last key tile that holds a key visible to one of its queries."""
    rows = q_pos.numel() * group
    blocks = triton.cdiv(rows, block_m)
    pos = q_pos.to(torch.int64).repeat_interleave(group)
    pos = torch.cat([pos, pos.new_full((blocks * block_m - rows,), -1)]).view(blocks, block_m).amax(1)
    visible = desc.tile_min_pos.unsqueeze(0).to(torch.int64) <= pos.unsqueeze(1)
    index = torch.arange(1, desc.num_tiles + 1, device=pos.device)
    return (visible * index).amax(1).to(torch.int32)


def _num_splits(programs: int, tiles: int, device: torch.device) -> int:
    """Split key tiles when too few programs would run (decode): aim at ~2 programs per SM."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(2 * sms // max(programs, 1), tiles // 4))


def view_attention_fwd(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       desc: ViewDescriptor, layer: int, scale: float, num_splits: int | None = None,
                       block_m: int | None = None) -> torch.Tensor:
    """Causal attention of q [Tq, H, D] (at logical positions ``q_pos`` [Tq]) over ``desc``'s view of one
    layer's store k_cache/v_cache [S, KVH, D]; ``layer`` picks the correction factors. -> [Tq, H, D]."""
    tq, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or dim % 2 or k_cache.shape[2] != dim:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the store's head_dim must be contiguous")
    if max(k_cache.shape[0] * k_cache.stride(0), v_cache.shape[0] * v_cache.stride(0)) >= 2**31:
        raise ValueError("one layer's store exceeds 2**31 elements (the kernel uses 32-bit offsets)")
    group = heads // kv_heads
    rows = tq * group                      # (query, group head) rows per KV head
    q = q.contiguous()
    q_pos = q_pos.to(device=q.device, dtype=torch.int32)
    block_m = block_m or (16 if rows <= 16 else 64)
    blocks = triton.cdiv(rows, block_m)
    ntiles = _row_block_tiles(q_pos, group, block_m, desc)
    splits = num_splits or _num_splits(blocks * kv_heads, desc.num_tiles, q.device)
    per_split = triton.cdiv(desc.num_tiles, splits)

    rank_pad = desc.uk.shape[-1]
    has_corr = desc.num_corrections > 0 and rank_pad > 0
    if has_corr:
        # Pre-pass: q . B_k^T for every correction, rows ordered (query, group head) like the kernel's.
        qg = q.float().view(tq, kv_heads, group, dim)
        qb = torch.einsum("tkgd,ckrd->cktgr", qg, desc.bk[:, layer].float())
        qb = qb.reshape(desc.num_corrections, kv_heads, rows, rank_pad).contiguous()
        uk, uv, bv = desc.uk[layer], desc.uv[layer], desc.bv[:, layer]
    else:
        rank_pad = 16
        qb = uk = uv = bv = torch.zeros(1, 1, 1, 1, device=q.device)
        uk, uv = uk[0], uv[0]

    if splits > 1:
        o = torch.empty(splits, tq, heads, dim, device=q.device, dtype=torch.float32)
        m = torch.empty(splits, tq, heads, device=q.device, dtype=torch.float32)
        l_ = torch.empty_like(m)
    else:
        o = torch.empty(1, tq, heads, dim, device=q.device, dtype=q.dtype)
        m = l_ = o.new_empty(1, 1, 1, dtype=torch.float32)
    lowp = q.dtype != torch.float32 and not interpreting()
    _view_attn_kernel[(blocks, kv_heads, splits)](
        q, q_pos, o, m, l_, k_cache, v_cache,
        desc.key_slots, desc.key_pos, ntiles, desc.tile_rot, desc.tile_corr, desc.tile_ncorr, desc.cos, desc.sin,
        desc.key_urow, qb, uk, uv, bv,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), o.stride(2), m.stride(0), m.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        desc.key_urow.stride(0), qb.stride(0), qb.stride(1), uk.stride(0), uk.stride(1),
        bv.stride(0), bv.stride(1), bv.stride(2),
        rows, per_split, scale * 1.4426950408889634,
        G=group, D=dim, BLOCK_D=triton.next_power_of_2(dim), RP=rank_pad, BLOCK_M=block_m,
        BLOCK_N=desc.block_n, HAS_CORR=has_corr, SPLIT=splits > 1, LOWP=lowp,
        num_warps=8 if block_m * dim >= 64 * 128 else 4)
    if splits == 1:
        return o[0]
    top = m.amax(0, keepdim=True)
    w = torch.exp2(m - top)                                     # [splits, Tq, H]
    den = (w * l_).sum(0).clamp_min(1e-30)
    return ((w.unsqueeze(-1) * o).sum(0) / den.unsqueeze(-1)).to(q.dtype)
