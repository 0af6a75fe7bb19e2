"""Plain attention primitives: causal SDPA over gathered KV, grouped matmuls for few queries, and
attention of scattered rows over a context (GQA throughout)."""
from __future__ import annotations

import torch
import torch.nn.functional as F



# Up to this many queries on CPU, attention runs as grouped matmuls: against PyTorch's fused kernel they
# are even up to 8 queries over a 2,000-token context and slower beyond (16: 0.74 against 0.66 ms a
# layer, 47: 3.7 against 1.7; docs/speed.md), which a turn's tail of a few dozen tokens pays in every layer.
SMALL_QUERY = 8


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [n, H, D] -> [KVH, G*n, D], row g*n + i for query i of group head g (GQA as matmuls)."""
    n, heads, d = q.shape
    g = heads // kv_heads
    return q.view(n, kv_heads, g, d).permute(1, 2, 0, 3).reshape(kv_heads, g * n, d)


def ungroup(out: torch.Tensor, n: int) -> torch.Tensor:
    """``group_queries``'s layout back: [KVH, G*n, D] -> [n, H, D]."""
    kv_heads, rows, d = out.shape
    return out.view(kv_heads, rows // n, n, d).permute(2, 0, 1, 3).reshape(n, rows // n * kv_heads, d)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as matmuls over KV-head groups (no K/V expansion): q [n, H, D], k/v [ctx, KVH, D],
    ``visible`` [n, ctx] (None: every key). Returns the output [n, H, D] and the probabilities
    [KVH, G, n, ctx]."""
    n, heads, _ = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    g = heads // kvh
    scores = ((group_queries(q, kvh) @ k.permute(1, 2, 0)) * scale).view(kvh, g, n, ctx)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return ungroup(probs.view(kvh, g * n, ctx) @ v.transpose(0, 1), n), probs


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """sdpa() for few queries on CPU."""
    n, ctx = q.shape[0], k.shape[0]
    visible = None
    if n > 1:
        visible = torch.arange(ctx, device=q.device) <= torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
    return grouped_attention(q, k, v, scale, visible)[0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention over [heads, n, D] tensors, given a batch dimension: PyTorch's
    fused kernels (flash attention on CPU too) take only 4-D inputs, and 3-D ones fall back to the
    math path, which materializes every score (on CPU about 6x slower for a 1,700-token prefill)."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), **kw).squeeze(0)


# Rows recomputed inside a reused range attend in chunks of queries, each chunk's keys cut at its last
# row, so the causal upper half is never scored (a full [rows, ctx] mask scores it and masks it out:
# about twice the work over a long view).
ROW_CHUNK = 256


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                   chunk: int = ROW_CHUNK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of queries at ``positions`` [n] (ascending for speed, any order is correct) over
    keys at positions [0, ctx): query i sees keys up to positions[i]. q [n, H, D], k/v [ctx, KVH, D].
    ``dtype``: the inputs rounded to it (the fused kernel sums in fp32), the output back in q's dtype."""
    if dtype is not None and dtype != q.dtype and q.shape[0] > 0:
        return rows_attention(q.to(dtype), k.to(dtype), v.to(dtype), positions, scale, chunk).to(q.dtype)
    outs = []
    for s in range(0, q.shape[0], chunk):
        pos = positions[s:s + chunk]
        hi = min(int(pos.max()) + 1, k.shape[0])
        visible = torch.arange(hi, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)
        out = _sdpa(q[s:s + chunk].transpose(0, 1), k[:hi].transpose(0, 1), v[:hi].transpose(0, 1),
                    attn_mask=visible, scale=scale, enable_gqa=True)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last n = len(q) positions of a context of len(k) tokens.

    q [n, H, D], k/v [ctx, KVH, D] -> [n, H, D].
    """
    n, ctx = q.shape[0], k.shape[0]
    if n <= SMALL_QUERY and q.device.type == "cpu":
        return _grouped(q, k, v, scale)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if n == 1:
        out = _sdpa(qh, kh, vh, scale=scale, enable_gqa=True)
    elif n == ctx:
        out = _sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at position ctx - n + j and sees every key up to it.
        rows = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
        out = _sdpa(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
