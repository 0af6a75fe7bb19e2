"""KVCMASConfig: the knobs of KVCMAS that a user may set."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..options import DEFAULT_RANK, DEFAULT_RECOMPUTE_RATIO, DEFAULT_REFERENCE, REFERENCES
from ..storage.spec import StorageSpec

PREFETCH: tuple[str, ...] = ("off", "idle", "decode")
DECODE_COPY: tuple[str, ...] = ("off", "auto")
DECODE_COPY_MIN = 16        # decode tokens from which "auto" copies a request's view
RECOMPUTE_DTYPES: tuple[str, ...] = ("model", "bfloat16", "auto")


@dataclass
class KVCMASConfig:
    """KVCMAS settings (docs/method.md).

    recompute_ratio: fraction of a reused segment's tokens recomputed under the agent's own prefix,
        chosen by the attention mass the prompt's tail puts on them (1.0 is exact).
    rank: SVD rank of each correction, per layer and KV head.
    reference: "home" corrects the exact home view; "chain" the graph predecessor's corrected view.
    prefetch: correct the shared segments for an agent's graph successors ahead of time: "decode" while
        other requests decode (between their steps) and, if still queued, right before the successor's
        request is admitted; "idle" only while no request runs or waits (a successor that arrives first
        corrects inline); "off" never. True and False mean "decode" and "off".
    prefetch_ratio: recompute ratio of those ahead-of-time corrections (at least recompute_ratio):
        they are selected before the successor's real tail is known.
    recompute_newest: recompute whole the newest reused message, and the newest reused reply when it
        starts near the tail, on top of recompute_ratio (no ahead-of-time correction covers them).
    decode_copy: "off" decodes over the corrected view as it is (realigned and corrected on the fly in
        every step); "auto" writes the view into blocks of the request's own for the length of its decode
        when it may decode at least DECODE_COPY_MIN tokens and the blocks fit the KV budget (faster decode
        steps, more KV memory while it runs).
    recompute_dtype: precision of the recompute's projections and attention and the selection pass's
        projections (norms, the selection's mass and the stored deviations stay in the model's dtype;
        the own tail's prefill is untouched): "model" keeps the model's; "bfloat16" rounds their inputs
        to bf16 (on a CPU with AMX tiles 3-5x fp32's rate); "auto" takes bf16 for an fp32 model on such
        a CPU, else the model's. bf16 keeps KL but flips greedy near-ties: it misses the fidelity
        harness's agreement target with nothing declared (docs/speed.md), so it is opt-in. A recompute
        ratio of 1.0 always keeps the model's (it stays exact).
    storage: how corrections are stored (StorageSpec).
    """

    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    rank: int = DEFAULT_RANK
    reference: str = DEFAULT_REFERENCE
    prefetch: str = "decode"
    prefetch_ratio: float = 0.9
    recompute_newest: bool = True
    decode_copy: str = "off"
    recompute_dtype: str = "model"
    storage: StorageSpec = field(default_factory=StorageSpec)

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {self.rank!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")
        if not 0.0 <= self.prefetch_ratio <= 1.0:
            raise ValueError(f"prefetch_ratio must be in [0, 1], got {self.prefetch_ratio}")
        if isinstance(self.prefetch, bool):
            self.prefetch = "decode" if self.prefetch else "off"
        if self.prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {PREFETCH} (or a bool), got {self.prefetch!r}")
        if self.decode_copy not in DECODE_COPY:
            raise ValueError(f"decode_copy must be one of {DECODE_COPY}, got {self.decode_copy!r}")
        if self.recompute_dtype not in RECOMPUTE_DTYPES:
            raise ValueError(f"recompute_dtype must be one of {RECOMPUTE_DTYPES}, got {self.recompute_dtype!r}")
        if not isinstance(self.storage, StorageSpec):
            raise ValueError(f"storage must be a StorageSpec, got {self.storage!r}")
