"""Dataclass configs for the engine and for sampling."""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, InvalidRequestError
from ..model.blocks import WEIGHTS
from ..model.loader import DEFAULT_MODEL
from ..model.logprobs import MAX_TOP_LOGPROBS
from ..reuse import KVCMASConfig, ReuseOptions, StorageSpec, method_class, names
from ..reuse.views import VIEW_PATHS

__all__ = ["DEFAULT_MODEL", "EngineConfig", "KVCMASConfig", "ReuseOptions", "SamplingParams", "StorageSpec"]


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _real(x: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MAX_LOGIT_BIAS = 300          # OpenAI's limit on logit_bias entries
_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")


@dataclass
class EngineConfig:
    """How one embedded engine is built.

    model: None or "smollm2-135m-instruct" for the default packaged model, a local checkpoint
        directory (safetensors + tokenizer), a path to a ``.gguf`` file, or "random:<shape>".
    device: "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N".
    dtype: None picks bf16 on CUDA and fp32 on CPU; else "float32", "bfloat16", "float16".
    weights: "auto" (decode-sized products of a GGUF checkpoint read its Q4_1 / Q8_0 blocks, fp32 on
        the CPU, where the compiled kernel builds; otherwise dense), "dense" (always the fp32 / dtype
        tensors), "blocks" (an error where they cannot serve) or "int8" (blocks, with each decode row
        rounded to int8 a block of 32 and the sums in integers, as llama.cpp computes them: faster, and
        no longer exact: a decode step's logits move by the rounding, and KV a decode step wrote differs
        from a fresh prefill's). Blocks expand into exactly the dense weights; with fp32 rows only the
        order of each sum differs (docs/speed.md, "Weights").
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
    methods: each reuse method's settings by name, e.g. {"kvcmas": KVCMASConfig(rank=20),
        "cacheblend": CacheBlendConfig(ratio=0.2)}; a method left out uses its own defaults.
    kvcmas, baselines: deprecated spellings of ``methods["kvcmas"]`` and of the other entries; given,
        they fold into ``methods``. Read back, they mirror it (KVCMAS's settings in use; the rest).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    weights: str = "auto"
    reuse: str = "prefix"
    kv_budget_bytes: int = 2 * 1024**3
    block_size: int = 16
    max_batch_tokens: int = 1024
    max_num_seqs: int = 32
    max_context: int | None = None
    num_threads: int | None = None
    cache_dir: str | None = None
    view_path: str = "auto"
    methods: dict[str, Any] = field(default_factory=dict)
    kvcmas: KVCMASConfig | None = field(default=None, repr=False)          # deprecated: methods["kvcmas"]
    baselines: dict[str, Any] | None = field(default=None, repr=False)     # deprecated: methods[name]

    def __post_init__(self) -> None:
        try:
            folded = self._fold_aliases()
            self._check_methods()
            self._check()
        except ConfigError:
            raise
        except ValueError as exc:        # e.g. method_class naming the reuse modes
            raise ConfigError(str(exc)) from None
        if folded:                       # a valid config that spells its settings the old way
            warnings.warn(f"EngineConfig(kvcmas=, baselines=) are deprecated: pass methods={{{folded[0]!r}: ...}}",
                          DeprecationWarning, stacklevel=3)

    def _check(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a name, a path (str) or None, got {self.model!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype is not None and not isinstance(self.dtype, (str, torch.dtype)):
            raise ConfigError(f"dtype must be a name like 'float32' or None, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if not isinstance(self.reuse, str):
            raise ConfigError(f"reuse must be a mode name, got {self.reuse!r}")
        method_class(self.reuse)              # ValueError names the modes
        if self.num_threads is not None and not _positive_int(self.num_threads):
            raise ConfigError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if self.view_path not in VIEW_PATHS:
            raise ConfigError(f"view_path must be one of {VIEW_PATHS}, got {self.view_path!r}")
        if not all(_positive_int(x) for x in (self.block_size, self.max_batch_tokens, self.max_num_seqs)):
            raise ConfigError("block_size, max_batch_tokens and max_num_seqs must be positive ints, got "
                              f"{self.block_size!r}, {self.max_batch_tokens!r}, {self.max_num_seqs!r}")
        if not _positive_int(self.kv_budget_bytes):
            raise ConfigError(f"kv_budget_bytes must be a positive int, got {self.kv_budget_bytes!r}")
        if self.max_context is not None and not _positive_int(self.max_context):
            raise ConfigError(f"max_context must be a positive int or None, got {self.max_context!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ConfigError(f"cache_dir must be a path or None, got {self.cache_dir!r}")

    def _fold_aliases(self) -> list[str]:
        """Move what ``kvcmas=`` and ``baselines=`` hold into ``methods`` (they become mirrors of it once
        checked); returns the names they added. An alias equal to its ``methods`` entry (as
        ``dataclasses.replace`` passes it back) adds nothing."""
        if not isinstance(self.methods, dict):
            raise ConfigError(f"methods must be a dict of settings by method name, got {self.methods!r}")
        if self.kvcmas is not None and not isinstance(self.kvcmas, KVCMASConfig):
            raise ConfigError(f"kvcmas must be a KVCMASConfig, got {self.kvcmas!r}")
        if self.baselines is not None and not isinstance(self.baselines, dict):
            raise ConfigError(f"baselines must be a dict of settings by method name, got {self.baselines!r}")
        given = dict(self.baselines or {})
        if self.kvcmas is not None and self.kvcmas != KVCMASConfig():
            given["kvcmas"] = self.kvcmas
        methods, folded = dict(self.methods), []
        for name, settings in given.items():
            if name in methods and methods[name] != settings:
                raise ConfigError(f"{name!r}'s settings are given twice, in methods and in the deprecated "
                                  f"kvcmas= or baselines=, and differ: pass them in methods only")
            if name not in methods:
                methods[name] = settings
                folded.append(name)
        self.methods = methods
        self.kvcmas = None                          # set from methods once they are checked
        return folded

    def _check_methods(self) -> None:
        for name, settings in self.methods.items():
            if name not in names():
                raise ConfigError(f"methods names no reuse method {name!r}: reuse must be one of {names()}")
            cls = method_class(name)
            if cls.config_class is None:
                raise ConfigError(f"methods[{name!r}]: {name!r} takes no settings, got {settings!r}")
            if not isinstance(settings, cls.config_class):
                raise ConfigError(f"methods[{name!r}] must be a {cls.config_class.__name__}, got {settings!r}")
        self.kvcmas = method_class("kvcmas").settings_of(self)
        self.baselines = {n: s for n, s in self.methods.items() if n != "kvcmas"}


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
    # OpenAI's penalties over the tokens generated so far in this request, each in [-2, 2]:
    # logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None   # token id -> [-100, 100] added to its logit; <= 300 entries
    # Record each generated token's logprob (and its top_logprobs alternatives, 0-20): see model/logprobs.py.
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):      # JSON objects key token ids by strings
            self.logit_bias = {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)) or self.stop is None:
            self.stop = [s for s in (self.stop or []) if s]    # other types: rejected by validate()

    def validate(self) -> None:
        """Raise InvalidRequestError on settings no request can run with (wrong types included)."""
        if not _positive_int(self.max_tokens):
            raise InvalidRequestError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _real(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}")
        forced = self.forced_tokens
        if forced is not None and (not isinstance(forced, (list, tuple))
                                   or not all(isinstance(t, int) and not isinstance(t, bool) for t in forced)):
            raise InvalidRequestError(f"forced_tokens must be a list of token ids or None, got {forced!r}")
        rf = self.response_format
        if rf is not None and not (isinstance(rf, dict) and "type" in rf):
            raise InvalidRequestError(f"response_format must be a dict with a 'type', got {rf!r}")
        self._validate_openai_extras()

    def _validate_openai_extras(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids, "
                                          f"got {type(bias).__name__} of {len(bias) if isinstance(bias, dict) else '?'}")
            for tok, value in bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise InvalidRequestError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
                if not _real(value) or not -100.0 <= value <= 100.0:
                    raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], "
                                              f"got {value!r} for token {tok}")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError(f"logprobs must be a bool, got {self.logprobs!r}")
        k = self.top_logprobs
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if k and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=True")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError when logit_bias names a token id the model does not have."""
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary (size {vocab_size}): "
                                      f"{sorted(bad)[:5]}")
