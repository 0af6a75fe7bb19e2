"""The compared methods: one engine configuration each, all on the same engine code and model."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import EngineConfig


@dataclass(frozen=True)
class Method:
    """A reuse mode plus the knobs it runs with (None keeps the engine default)."""

    name: str
    reuse: str
    recompute_ratio: float | None = None
    rank: int | None = None
    reference: str | None = None

    def config(self, model: str | None, device: str, **extra) -> EngineConfig:
        knobs = {k: v for k, v in (("recompute_ratio", self.recompute_ratio), ("rank", self.rank),
                                   ("reference", self.reference)) if v is not None}
        return EngineConfig(model=model, device=device, reuse=self.reuse, **knobs, **extra)

    @property
    def label(self) -> str:
        if self.recompute_ratio is None and self.rank is None and self.reference is None:
            return self.name
        knobs = [f"r={self.recompute_ratio}" if self.recompute_ratio is not None else "",
                 f"k={self.rank}" if self.rank is not None else "", self.reference or ""]
        return f"{self.name}({','.join(k for k in knobs if k)})"


METHODS: dict[str, Method] = {
    "none": Method("none", "none"),                    # every request prefills its whole prompt
    "prefix": Method("prefix", "prefix"),              # per-agent exact prefix caching (vLLM/SGLang style)
    "naive": Method("naive", "naive"),                 # cross-agent reuse, RoPE realignment only
    "cacheblend": Method("cacheblend", "cacheblend", recompute_ratio=0.15),   # CacheBlend's ~15% HKVD
    "kvcomm": Method("kvcomm", "kvcomm"),              # anchor pool of full-size offsets
    "kvcmas": Method("kvcmas", "kvcmas"),              # ours, engine-default knobs
}
DEFAULT_METHODS: tuple[str, ...] = tuple(METHODS)


def sweep_methods(ratios: tuple[float, ...], ranks: tuple[int, ...], default_rank: int,
                  default_ratio: float) -> list[Method]:
    """kvcmas over recompute_ratio at the default rank, and over rank at the default ratio."""
    points = {(r, default_rank) for r in ratios} | {(default_ratio, k) for k in ranks}
    return [Method("kvcmas", "kvcmas", recompute_ratio=r, rank=k) for r, k in sorted(points)]
