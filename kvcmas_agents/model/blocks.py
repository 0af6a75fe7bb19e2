"""Weights kept in a GGUF's own blocks (Q4_1, Q8_0) for decode-sized products on the CPU.

A decode step reads every weight once for a handful of rows, so its time is the bytes it reads. The
default checkpoint is a GGUF of Q4_1 blocks (Q8_0 for the embedding); the loader expands it into fp32
for the reference path. Here the blocks are read back from the file, checked to expand into exactly
the fp32 weights the model holds, and decode-sized products read them as they are (4.5 or 8.5 bits a
weight instead of 32) through ``kernels.cpu_quant``. Wider products (prefill) keep the dense weights:
BLAS beats expanding blocks there.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import cpu_quant
from .args import ModelArgs

# Products of up to this many rows read the blocks; wider ones run dense (docs/speed.md, "Weights").
MAX_ROWS = 8
KINDS = ("Q4_1", "Q8_0")
_BYTES = {"Q4_1": 20, "Q8_0": 34}          # bytes a block of 32 takes in the file
_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


@dataclass
class BlockWeight:
    """One [N, K] weight in blocks of 32 along K: ``qs`` (Q4_1: [N, K/2] uint8 nibbles; Q8_0: [N, K]
    int8), ``d`` and (Q4_1) ``m`` [N, K/32] fp16 as in the file, and ``dense``, the fp32 weight they
    expand into (None for a stacked weight, whose parts keep theirs). With ``int8`` products quantize
    their rows to int8 a block of 32 and sum in integers (``cpu_quant.matmul``)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    dense: torch.Tensor | None
    bias: torch.Tensor | None = None
    int8: bool = False          # rows are quantized to int8 a block for the product (llama.cpp's way)

    @property
    def shape(self) -> torch.Size:
        k = self.qs.shape[1] * (2 if self.kind == "Q4_1" else 1)
        return torch.Size((self.qs.shape[0], k))

    @property
    def block_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @staticmethod
    def serves(x: torch.Tensor) -> bool:
        """Whether the blocks take x: up to MAX_ROWS fp32 rows [T, K]."""
        return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def product(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                glu: bool = False) -> torch.Tensor:
        """x [T, K] @ w.T (+ the weight's own bias) from the blocks; ``norm``: RMS-normalize x by these
        weights first; ``glu``: the weight is gate then up, and the result silu(gate) * up."""
        out = cpu_quant.matmul(x, self._ptrs, self.qs.shape[0], norm, eps, glu, self.int8)
        return out if self.bias is None else out + self.bias

    def __post_init__(self) -> None:
        self._ptrs = (self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ w.T (+ bias): from the blocks for up to MAX_ROWS fp32 rows, else dense."""
        if not self.serves(x):
            return F.linear(x, self.dense, bias)
        out = self.product(x)
        return out if bias is None else out + bias

    def expand(self) -> torch.Tensor:
        """The fp32 weight the blocks define (what the file's de-quantization gives)."""
        n, k = self.shape
        if self.m is None:
            return (self.d.float().unsqueeze(-1) * self.qs.view(n, k // 32, 32).float()).view(n, k)
        nib = self.qs.view(n, k // 32, 16)
        q = torch.cat([nib & 15, nib >> 4], dim=-1).float()
        return (self.d.float().unsqueeze(-1) * q + self.m.float().unsqueeze(-1)).view(n, k)


def stacked(parts: list[BlockWeight], biases: list[torch.Tensor | None]) -> BlockWeight | None:
    """One block weight whose output features are ``parts``' one after another (q, k and v; gate and up),
    so a decode step makes one call instead of several; no dense copy (wide products use the parts).
    None when the parts differ in kind or only some have a bias."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or len({b is None for b in biases}) != 1:
        return None
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)
    return BlockWeight(parts[0].kind, cat([p.qs for p in parts]), cat([p.d for p in parts]), cat([p.m for p in parts]),
                       None, cat(biases), parts[0].int8)


def from_raw(kind: str, raw: torch.Tensor, dense: torch.Tensor) -> BlockWeight:
    """A weight from its file bytes ``raw`` [N, K/32 * block bytes] uint8."""
    n, k = dense.shape
    blk = raw.reshape(n, k // 32, _BYTES[kind])
    scale = blk[..., 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
    if kind == "Q4_1":
        mins = blk[..., 2:4].contiguous().view(torch.float16).reshape(n, k // 32)
        return BlockWeight(kind, blk[..., 4:].contiguous().reshape(n, k // 2), scale, mins, dense)
    return BlockWeight(kind, blk[..., 2:].contiguous().view(torch.int8).reshape(n, k), scale, None, dense)


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (its rope pairs rows (i, i + D/2) as (2i, 2i+1))."""
    return torch.from_numpy(np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows).copy())


def _hf_name(gguf_name: str) -> tuple[str | None, str]:
    """(HF parameter name or None, the GGUF tensor's kind) for a GGUF tensor name."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight", "embed"
    if gguf_name == "output.weight":
        return "lm_head.weight", "output"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight", parts[2]
    return None, ""


def read_blocks(gguf: Path, args: ModelArgs, weights: dict[str, torch.Tensor]
                ) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """Block weights by HF name for every Q4_1 / Q8_0 tensor of ``gguf`` whose blocks expand into exactly
    ``weights[name]``; the rest by name with why they stay dense."""
    from gguf import GGUFReader

    blocks: dict[str, BlockWeight] = {}
    dense: dict[str, str] = {}
    for t in GGUFReader(str(gguf)).tensors:
        name, part = _hf_name(t.name)
        if name is None or name not in weights:
            continue
        kind = t.tensor_type.name
        want = weights[name]
        if kind not in KINDS or want.dtype != torch.float32 or want.device.type != "cpu" or want.shape[1] % 32:
            dense[name] = f"{kind} {tuple(want.shape)} {want.dtype}"
            continue
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8)).reshape(want.shape[0], -1)
        orders = [None]
        if part in ("attn_q", "attn_k"):
            orders.append(_rope_rows(want.shape[0], args.num_heads if part == "attn_q" else args.num_kv_heads))
        for rows in orders:
            weight = from_raw(kind, raw if rows is None else raw[rows], want)
            if torch.equal(weight.expand(), want):
                blocks[name] = weight
                break
        else:
            dense[name] = f"{kind} blocks do not expand into the checkpoint's weight"
    if args.tie_word_embeddings and "model.embed_tokens.weight" in blocks:
        blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
    return blocks, dense


WEIGHTS = ("auto", "dense", "blocks", "int8")


def choose(mode: str, gguf: str | None, args: ModelArgs, weights: dict[str, torch.Tensor]
           ) -> tuple[dict[str, BlockWeight], str]:
    """The block weights ``mode`` asks for and what serves the products, in words for ``Engine.stats``:
    "dense": none; "blocks": fp32 rows times the blocks (or raise); "auto": the same where the blocks
    can serve, else none; "int8": rows quantized to int8 a block, as llama.cpp's products do (or raise)."""
    if mode == "dense":
        return {}, "dense: asked for"
    why = None
    emb = weights.get("model.embed_tokens.weight")
    if gguf is None or not gguf.endswith(".gguf"):
        why = "the checkpoint is not a GGUF"
    elif not Path(gguf).is_file():
        why = f"its GGUF {gguf} is gone"
    elif emb is None or emb.device.type != "cpu" or emb.dtype != torch.float32:
        why = "blocks serve fp32 on the CPU"
    elif cpu_quant.load() is None:
        why = str(cpu_quant.unavailable())
    blocks: dict[str, BlockWeight] = {}
    if why is None:
        blocks, _ = read_blocks(Path(gguf), args, weights)
        why = None if blocks else "no Q4_1 / Q8_0 tensor of the GGUF matches the checkpoint"
    if why is not None:
        if mode != "auto":
            raise ValueError(f"weights={mode!r} cannot serve this model: {why}")
        return {}, f"dense: {why}"
    int8 = mode == "int8"
    kinds: dict[str, int] = {}
    wide = 0                    # int8 asked for, but a K that is not whole pairs of blocks keeps fp32 rows
    for name, w in blocks.items():
        w.int8 = int8 and w.shape[1] % 64 == 0
        if name != "lm_head.weight" or w is not blocks.get("model.embed_tokens.weight"):
            kinds[w.kind] = kinds.get(w.kind, 0) + 1
            wide += int8 and not w.int8
    loops = "" if (cpu_quant.int8_vectorized() if int8 else cpu_quant.vectorized()) else ", portable loops"
    rows = ("int8 rows" + (f", fp32 rows for {wide}" if wide else "")) if int8 else "fp32 rows"
    return blocks, "blocks (" + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) + f", {rows}{loops})"
