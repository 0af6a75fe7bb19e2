"""Per-request overrides of the engine's reuse settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .registry import method_class, names

REFERENCES: tuple[str, ...] = ("home", "chain")
# The knobs a request gets from a method that sets none of its own (ReuseMethod.defaults); KVCMASConfig
# starts from them too.
DEFAULT_RECOMPUTE_RATIO, DEFAULT_RANK, DEFAULT_REFERENCE = 0.5, 40, "home"


@dataclass
class ReuseOptions:
    """Per-request overrides of the engine's reuse knobs (None keeps the engine's setting).

    reuse: a reuse mode ("none", "prefix", "naive", "kvcmas", "cacheblend", "kvcomm").
    recompute_ratio, rank, reference: KVCMAS knobs; an unset one resolves to the mode's default
    (``ReuseMethod.defaults``: KVCMAS's settings; CacheBlend's own ratio for reuse="cacheblend").
    """

    reuse: str | None = None
    recompute_ratio: float | None = None
    rank: int | None = None
    reference: str | None = None

    def validate(self) -> None:
        if self.reuse is not None and self.reuse not in names():
            raise ValueError(f"reuse must be one of {names()}, got {self.reuse!r}")
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0):
            raise ValueError(f"rank must be a non-negative int, got {self.rank!r}")
        if self.reference is not None and self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")

    def resolve(self, config: Any) -> "ReuseOptions":
        """Fill unset knobs from an EngineConfig: the mode's own defaults."""
        reuse = self.reuse if self.reuse is not None else config.reuse
        ratio, rank, reference = method_class(reuse).defaults(config)
        return ReuseOptions(
            reuse,
            self.recompute_ratio if self.recompute_ratio is not None else ratio,
            self.rank if self.rank is not None else rank,
            self.reference if self.reference is not None else reference)
