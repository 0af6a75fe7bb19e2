"""Dataclass configs for the engine and for sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model.loader import DEFAULT_MODEL
from ..reuse import KVCMASConfig, ReuseOptions, StorageSpec, method_class
from ..reuse.views import VIEW_PATHS

__all__ = ["DEFAULT_MODEL", "EngineConfig", "KVCMASConfig", "ReuseOptions", "SamplingParams", "StorageSpec"]


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclass
class EngineConfig:
    """How one embedded engine is built.

    model: None or "smollm2-135m-instruct" for the default packaged model, a local checkpoint
        directory (safetensors + tokenizer), a path to a ``.gguf`` file, or "random:<shape>".
    device: "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N".
    dtype: None picks bf16 on CUDA and fp32 on CPU; else "float32", "bfloat16", "float16".
    reuse: the default reuse mode of requests: "none", "prefix" (each agent's own exact prefix cache),
        "naive" (other agents' segment KV, realigned only), "kvcmas", or a baseline ("cacheblend",
        "kvcomm"). A request may pick another with ``ReuseOptions``.
    kv_budget_bytes: upper bound on KV cache bytes; unreferenced cached blocks are evicted LRU.
    block_size: tokens per KV block.
    max_batch_tokens: tokens one forward step may process (long prompts are chunked).
    max_num_seqs: requests running at once; more wait in the queue.
    max_context: context window override (default: the checkpoint's).
    num_threads: intra-op threads of the engine's worker (None: those of the thread that builds the
        engine). The worker builds the model and runs all torch work, so a CPU process keeps one OpenMP
        thread team (docs/attention.md, "Threads").
    cache_dir: where converted checkpoints are cached (default ``$KVCMAS_CACHE_DIR`` or ~/.cache/kvcmas).
    view_path: attention over corrected views: "auto" (the Triton kernel on CUDA, else "gather"),
        "gather", "query" (the torch reference) or "triton".
    kvcmas: KVCMAS's settings (KVCMASConfig, with its StorageSpec).
    baselines: settings of the baseline methods by name, e.g. {"cacheblend": CacheBlendConfig(ratio=0.2)}.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    reuse: str = "prefix"
    kv_budget_bytes: int = 2 * 1024**3
    block_size: int = 16
    max_batch_tokens: int = 1024
    max_num_seqs: int = 32
    max_context: int | None = None
    num_threads: int | None = None
    cache_dir: str | None = None
    view_path: str = "auto"
    kvcmas: KVCMASConfig = field(default_factory=KVCMASConfig)
    baselines: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        method_class(self.reuse)              # ValueError names the modes
        if self.num_threads is not None and not _positive_int(self.num_threads):
            raise ValueError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if self.view_path not in VIEW_PATHS:
            raise ValueError(f"view_path must be one of {VIEW_PATHS}, got {self.view_path!r}")
        if not all(_positive_int(x) for x in (self.block_size, self.max_batch_tokens, self.max_num_seqs)):
            raise ValueError("block_size, max_batch_tokens and max_num_seqs must be positive")
        if self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget_bytes must be positive")
        if not isinstance(self.kvcmas, KVCMASConfig):
            raise ValueError(f"kvcmas must be a KVCMASConfig, got {self.kvcmas!r}")
        for name, settings in self.baselines.items():
            cls = method_class(name)
            if cls.config_class is None or not isinstance(settings, cls.config_class):
                want = cls.config_class.__name__ if cls.config_class else "no settings"
                raise ValueError(f"baselines[{name!r}] must be a {want}, got {settings!r}")


@dataclass
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    return_logits: bool = False       # keep each generated step's fp32 logits (fidelity harness, tests)
    forced_tokens: list[int] | None = None   # teacher forcing: feed these instead of sampled tokens
    # OpenAI-style: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}
    # constrains decoding to that JSON (docs/structured_output.md); None or {"type": "text"}: free text.
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]

    def validate(self) -> None:
        """Raise ValueError on settings no request can run with."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.response_format is not None and not (isinstance(self.response_format, dict)
                                                     and "type" in self.response_format):
            raise ValueError(f"response_format must be a dict with a 'type', got {self.response_format!r}")
