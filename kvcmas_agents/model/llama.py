"""Llama-family forward pass (Llama, Qwen2, Mistral, SmolLM) over plain weight tensors.

The model never owns a KV cache. Each layer hands its rotated q/k/v to an ``AttentionBackend``,
which decides where keys and values live and what each token attends to. That seam lets the engine
use a paged cache and lets a correction step recompute a chosen subset of tokens, layer by layer,
against any KV view it supplies.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F

from ..kernels import cpu_quant
from ..switches import SWITCHES
from .args import ModelArgs
from .blocks import MAX_ROWS, BlockWeight, stacked
from .rope import RotaryEmbedding, rotate, rotate_, signed_sin


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the step's new tokens -> attention output [T, H, D]."""
        ...

    # A backend may also have ``attend_qkv(layer, qkv, cos, sin_signed) -> [T, H, D] | None``: the fused
    # product's unrotated rows [T, (H + 2 KVH) * D] and their RoPE rows, rotated, stored and attended in
    # one call (``engine.paged_attention``); None, with qkv untouched, where it does not serve them.


# fp32 projections of 1-4 rows on CPU (decode steps) run as ``w @ x.T`` rather than ``F.linear(x, w)``:
# the same product through PyTorch's matrix-matrix path, measured 1.2-2.3x faster at 2-4 rows; from 5
# rows on it gained little or lost (0.8-1.1x, made contiguous), so wider products keep ``F.linear``.
# One row takes that path as two (the row twice): a one-column product goes to the matrix-vector path,
# as slow as ``F.linear``'s, and the second row costs nothing while the weights' reads bound the step
# (a step's projections 1.9x faster; docs/speed.md). ``switches.cpu_matmul``.
MATMUL_ROWS = 4


def linear(x: torch.Tensor, w: torch.Tensor | BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w[out, in].T (+ b): F.linear, or on CPU in fp32 for a few rows the matrix-matrix
    path, or a block weight's own product. The result is contiguous either way: attention's fused kernels
    take the heads split off it, and a transposed one sent prefill attention to PyTorch's slow path."""
    if isinstance(w, BlockWeight):
        return w(x, b)
    rows = x.shape[0] if x.dim() == 2 else 0
    if not (SWITCHES.cpu_matmul and 1 <= rows <= MATMUL_ROWS and x.device.type == "cpu" and x.dtype == torch.float32):
        return F.linear(x, w, b)
    xs = torch.cat([x, x]) if rows == 1 else x
    out = (w @ xs.t()).t()[:rows].contiguous()
    return out if b is None else out + b


def wide_linear(x: torch.Tensor, w: torch.Tensor | BlockWeight, b: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T (+ b) with inputs rounded to ``dtype`` and the result back in x's dtype: a prefill-sized
    product on the CPU's bf16 matrix units (AMX: 3-5x fp32's rate), the weight cast per call (no copy
    kept)."""
    dense = w.dense if isinstance(w, BlockWeight) else w
    out = F.linear(x.to(dtype), dense.to(dtype), None if b is None else b.to(dtype))
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One op instead of six, bitwise equal to the lines below in fp32 (checked on 3,000 random rows).
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalise in fp32 like the reference implementations, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Functional Llama-family transformer. Weights use HF parameter names."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], max_positions: int,
                 blocks: dict[str, BlockWeight] | None = None):
        """``blocks``: weights by name kept in a GGUF's blocks too (``model.blocks``), used for the
        decode-sized products they name; every weight stays in ``weights`` as well."""
        self.args = args
        self.w = weights
        self._blocks = blocks or {}
        emb = weights["model.embed_tokens.weight"]
        self.device, self.dtype = emb.device, emb.dtype
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling,
                                    args.max_position_embeddings, max_positions, self.device, self.dtype)
        self.scale = args.head_dim ** -0.5
        self._signed_sin = signed_sin(self.rope.sin)
        self._rope_rows: tuple = (None, None, None, None)    # positions, cos, sin, signed sin of the last step
        self._layers = [self._layer_weights(i) for i in range(args.num_layers)]
        self._lm_head = self._weight("lm_head.weight")
        del self._blocks          # what the layers use is theirs now; the rest is let go
        used = {id(w): w for lw in self._layers for w in lw.values() if isinstance(w, BlockWeight)}
        if isinstance(self._lm_head, BlockWeight):
            used[id(self._lm_head)] = self._lm_head
        self.block_bytes = sum(w.block_bytes for w in used.values())
        self.wide_dtype: torch.dtype | None = None      # ``products``: wide products' input precision

    @contextmanager
    def products(self, dtype: torch.dtype | None) -> Iterator[None]:
        """Within the block, products wider than a decode step's (more than MAX_ROWS rows) take their
        inputs in ``dtype`` (None: as they are). For passes whose result is an approximation anyway
        (KVCMAS's recompute and selection); the model runs on one worker thread."""
        saved, self.wide_dtype = self.wide_dtype, (None if dtype == self.dtype else dtype)
        try:
            yield
        finally:
            self.wide_dtype = saved

    def _linear(self, x: torch.Tensor, w: torch.Tensor | BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.wide_dtype is not None and x.shape[0] > MAX_ROWS:
            return wide_linear(x, w, b, self.wide_dtype)
        return linear(x, w, b)

    def _layer_weights(self, i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        g = self.w.get
        w = self._weight
        lw = {
            "in_norm": self.w[p + "input_layernorm.weight"],
            "post_norm": self.w[p + "post_attention_layernorm.weight"],
            "q": w(p + "self_attn.q_proj.weight"), "q_b": g(p + "self_attn.q_proj.bias"),
            "k": w(p + "self_attn.k_proj.weight"), "k_b": g(p + "self_attn.k_proj.bias"),
            "v": w(p + "self_attn.v_proj.weight"), "v_b": g(p + "self_attn.v_proj.bias"),
            "o": w(p + "self_attn.o_proj.weight"), "o_b": g(p + "self_attn.o_proj.bias"),
            "gate": w(p + "mlp.gate_proj.weight"),
            "up": w(p + "mlp.up_proj.weight"),
            "down": w(p + "mlp.down_proj.weight"),
        }
        # Decode-sized steps make one call for q, k and v, and one for gate and up (fewer calls a step).
        # Wider steps then use the parts' dense weights, so the parts' own blocks are let go.
        for fused, names in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
            parts = [lw[n] for n in names]
            if all(isinstance(x, BlockWeight) for x in parts):
                lw[fused] = stacked(parts, [lw.get(n + "_b") for n in names])
                if lw[fused] is not None:
                    lw.update({n: x.dense for n, x in zip(names, parts)})
        if isinstance(lw["o"], BlockWeight) and lw["o_b"] is None and lw.get("gate_up") is not None \
                and isinstance(lw["down"], BlockWeight):
            lw["tail"] = (lw["o"]._ptrs, lw["gate_up"]._ptrs, lw["down"]._ptrs)
        return lw

    def _weight(self, name: str) -> torch.Tensor | BlockWeight:
        return self._blocks.get(name) or self.w[name]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.w["model.embed_tokens.weight"])

    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor):
        """Pre-norm and project hidden states h [T, hidden]; returns rotated q, k and plain v."""
        a, lw = self.args, self._layers[layer]
        cos, sin, sin_signed = self._rope_of(positions)
        out = self._fused_qkv(layer, h)
        if out is not None:
            return self._split_rotate(out, cos, sin_signed)
        t = h.shape[0]
        x = rms_norm(h, lw["in_norm"], a.rms_norm_eps)
        q = self._linear(x, lw["q"], lw["q_b"]).view(t, a.num_heads, a.head_dim)
        k = self._linear(x, lw["k"], lw["k_b"]).view(t, a.num_kv_heads, a.head_dim)
        v = self._linear(x, lw["v"], lw["v_b"]).view(t, a.num_kv_heads, a.head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _fused_qkv(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        """q, k and v of a decode-sized step normed and projected in one call from the blocks, unrotated
        [T, (H + 2 KVH) * D]; None where the blocks do not serve h."""
        fused = self._layers[layer].get("qkv")
        if fused is None or not fused.serves(h):
            return None
        return fused.product(h, self._layers[layer]["in_norm"], self.args.rms_norm_eps)

    def _split_rotate(self, out: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        """q, k and v of the fused product's rows, q and k side by side rotated together in place (bitwise
        as ``rotate``)."""
        a, t = self.args, out.shape[0]
        heads = a.num_heads + a.num_kv_heads
        qk = rotate_(out[:, :heads * a.head_dim].view(t, heads, a.head_dim), cos, sin_signed)
        q, k = qk[:, :a.num_heads], qk[:, a.num_heads:]
        v = out[:, heads * a.head_dim:].view(t, a.num_kv_heads, a.head_dim)
        return (q, k, v) if t == 1 else (q.contiguous(), k.contiguous(), v.contiguous())

    def _rope_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and signed sin rows [T, 1, D] of ``positions``, gathered once for all layers of a step."""
        if self._rope_rows[0] is not positions:
            cos, sin = self.rope.cos_sin(positions)
            self._rope_rows = (positions, cos, sin, self._signed_sin[positions].unsqueeze(1))
        return self._rope_rows[1:]

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the SwiGLU MLP block."""
        lw = self._layers[layer]
        attn_out = attn_out.reshape(h.shape[0], -1)
        tail = lw.get("tail")
        if tail is not None and BlockWeight.serves(h):     # o, residual, norm, gate/up, silu, down, residual
            return cpu_quant.layer_tail(h, attn_out, lw["post_norm"], self.args.rms_norm_eps, *tail,
                                        self.args.intermediate_size, lw["down"].int8)
        h = h + self._linear(attn_out, lw["o"], lw["o_b"])
        fused = lw.get("gate_up")
        if fused is not None and fused.serves(h):
            act = fused.product(h, lw["post_norm"], self.args.rms_norm_eps, glu=True)   # norm, gate, up, silu
        else:
            x = rms_norm(h, lw["post_norm"], self.args.rms_norm_eps)
            act = F.silu(self._linear(x, lw["gate"])) * self._linear(x, lw["up"])
        return h + self._linear(act, lw["down"])

    def layer(self, layer: int, h: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        fused = getattr(attn, "attend_qkv", None)
        if fused is not None and (out := self._fused_qkv(layer, h)) is not None:
            cos, _, sin_signed = self._rope_of(positions)
            o = fused(layer, out, cos, sin_signed)
            if o is not None:
                return self.finish_layer(layer, h, o)
            return self.finish_layer(layer, h, attn(layer, *self._split_rotate(out, cos, sin_signed)))
        q, k, v = self.qkv(layer, h, positions)
        return self.finish_layer(layer, h, attn(layer, q, k, v))

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Run all layers over flat tokens [T]; returns final-normed hidden states [T, hidden]."""
        h = self.embed(token_ids)
        for i in range(self.args.num_layers):
            h = self.layer(i, h, positions, attn)
        return rms_norm(h, self.w["model.norm.weight"], self.args.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project final hidden states to fp32 vocabulary logits."""
        return linear(hidden, self._lm_head).float()
