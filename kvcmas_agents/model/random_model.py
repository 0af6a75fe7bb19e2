"""Randomly initialised Llama-shaped models (``model="random:<shape>"``) for speed and memory runs.

A GPU benchmark needs a large model's shapes, not its weights: attention, KV and correction costs
depend only on the shapes. Weights are seeded normal(0, 0.02) made directly on the device; the tokenizer
and chat template come from the default packaged model, so prompts tokenize as usual (the vocab is the
tokenizer's). Outputs are meaningless: never use these for fidelity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import ModelArgs, expected_shapes

PREFIX = "random:"


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192


SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128),
    "llama3-1b": Shape(2048, 8192, 16, 32, 8, 64),
    # Llama-3-8B's attention and KV geometry (32 layers, 32 query heads, 8 KV heads of 128) with narrow
    # hidden and MLP widths: the KV, correction and anchor bytes of an 8B-shaped run at a CPU's cost.
    "llama3-8b-kv": Shape(1024, 2048, 32, 32, 8, 128),
    "tiny": Shape(64, 128, 2, 4, 2, 16, rope_theta=10000.0, max_position_embeddings=4096),
}


def is_random(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)


def random_args(model: str, vocab_size: int, eos_token_ids: list[int]) -> ModelArgs:
    name = model[len(PREFIX):]
    if name not in SHAPES:
        raise ValueError(f"unknown random model shape {name!r}; choose from {sorted(SHAPES)}")
    s = SHAPES[name]
    return ModelArgs(vocab_size=vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                     num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                     head_dim=s.head_dim, rope_theta=s.rope_theta, max_position_embeddings=s.max_position_embeddings,
                     eos_token_ids=list(eos_token_ids))


def random_weights(args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the model expects, normal(0, 0.02) (norm weights 1), seeded, made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(args).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return weights
