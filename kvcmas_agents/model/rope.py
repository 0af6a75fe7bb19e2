"""Rotary position embeddings, including the checkpoint's rope scaling.

Scalings whose frequencies depend only on the position (default, linear, llama3, yarn) are supported;
they make a rotation by a position delta exact, which later reuse relies on. Dynamic NTK and
longrope change frequencies with the sequence length and are refused.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_SCALINGS = ("default", "linear", "llama3", "yarn")


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies [head_dim // 2] in fp64, cos/sin attention factor)."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in SUPPORTED_SCALINGS:
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_SCALINGS}")
    if kind == "default":
        return base, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return base / factor, 1.0
    if kind == "llama3":
        return _llama3(base, factor, scaling), 1.0
    return _yarn(head_dim, theta, factor, scaling, max_position_embeddings)


def _llama3(base: torch.Tensor, factor: float, s: dict[str, Any]) -> torch.Tensor:
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    orig = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / base
    low_wavelen, high_wavelen = orig / low, orig / high
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)
    # Wavelengths between the two cut-offs blend the scaled and unscaled frequency.
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


def _yarn(dim: int, theta: float, factor: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = float(s.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolate = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``rotate`` applies them (HF rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int, max_positions: int, device: torch.device,
                 dtype: torch.dtype):
        inv, self.attention_factor = inv_frequencies(head_dim, theta, scaling, max_position_embeddings)
        self.inv_freq = inv.to(torch.float32)
        pos = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = (emb.cos() * self.attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * self.attention_factor).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for integer positions, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [T, heads, head_dim] with cos/sin [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """A rotate-half sin table with its first half negated, the form ``rotate_`` takes."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``rotate`` in place, given cos and ``signed_sin(sin)``: x * cos + swap_halves(x) * sin_signed.
    Bitwise equal to ``rotate`` (negating a factor is exact, every product and sum is rounded as there),
    in four whole-width ops: on CPU the six half-width strided ops it replaces took 1.6x as long, and a
    decode over a view with many rotated segments rotates its reused keys in every layer."""
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    return x.mul_(cos).add_(swapped)
