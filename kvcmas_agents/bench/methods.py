"""The compared methods: one engine configuration each, all on the same engine code and model."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import EngineConfig, KVCMASConfig, StorageSpec

# Method knobs that are StorageSpec fields, by StorageSpec name.
STORAGE = {"value_bits": "value_bits", "key_bits": "key_bits", "small_rows": "small_rows",
           "small_row_bits": "small_row_bits", "u_head_bits": "u_head_bits",
           "uncorrected_energy": "uncorrected_energy", "correction_dtype": "dtype", "u8_components": "u8_components"}


@dataclass(frozen=True)
class Method:
    """A reuse mode plus the knobs it runs with: KVCMASConfig's and StorageSpec's fields (None keeps the
    default; u8_components="all" keeps every component of U at its head bits)."""

    name: str
    reuse: str
    recompute_ratio: float | None = None
    rank: int | None = None
    reference: str | None = None
    prefetch: bool | str | None = None
    prefetch_ratio: float | None = None
    decode_copy: str | None = None
    value_bits: int | None = None
    key_bits: int | None = None
    small_rows: bool | None = None
    small_row_bits: int | None = None
    u_head_bits: int | None = None
    uncorrected_energy: float | None = None
    correction_dtype: str | None = None
    u8_components: int | str | None = None

    def _knobs(self) -> dict:
        return {k: getattr(self, k) for k in ("recompute_ratio", "rank", "reference", "prefetch", "prefetch_ratio",
                                              "decode_copy",
                                              "value_bits", "key_bits", "small_rows", "small_row_bits", "u_head_bits",
                                              "uncorrected_energy", "correction_dtype", "u8_components")
                if getattr(self, k) is not None}

    def config(self, model: str | None, device: str, **extra) -> EngineConfig:
        knobs = self._knobs()
        storage = {STORAGE[k]: knobs.pop(k) for k in list(knobs) if k in STORAGE}
        if storage.get("u8_components") == "all":
            storage["u8_components"] = None
        return EngineConfig(model=model, device=device, reuse=self.reuse,
                            methods={"kvcmas": KVCMASConfig(**knobs, storage=StorageSpec(**storage))}, **extra)

    @property
    def label(self) -> str:
        short = {"recompute_ratio": "r", "rank": "k", "reference": "ref", "prefetch": "prefetch",
                 "prefetch_ratio": "pr", "decode_copy": "copy", "value_bits": "vbits", "key_bits": "kbits",
                 "small_rows": "rows", "small_row_bits": "rbits", "u_head_bits": "hbits", "uncorrected_energy": "faint",
                 "correction_dtype": "dtype",
                 "u8_components": "u8"}
        knobs = self._knobs()
        if not knobs:
            return self.name
        return f"{self.name}({','.join(f'{short[k]}={v}' for k, v in knobs.items())})"


METHODS: dict[str, Method] = {
    "none": Method("none", "none"),                    # every request prefills its whole prompt
    "prefix": Method("prefix", "prefix"),              # per-agent exact prefix caching (vLLM/SGLang style)
    "naive": Method("naive", "naive"),                 # cross-agent reuse, RoPE realignment only
    "cacheblend": Method("cacheblend", "cacheblend"),  # CacheBlend at its paper's ~15% (CacheBlendConfig)
    "kvcomm": Method("kvcomm", "kvcomm"),              # anchor pool of full-size offsets
    "kvcmas": Method("kvcmas", "kvcmas"),              # ours, engine-default knobs
    # ours with each decoding request's view written into its own blocks for the decode (KVCMASConfig.decode_copy)
    "kvcmas-copy": Method("kvcmas-copy", "kvcmas", decode_copy="auto"),
    # ours with ahead-of-time corrections only while the engine idles (KVCMASConfig.prefetch="idle")
    "kvcmas-idle": Method("kvcmas-idle", "kvcmas", prefetch="idle"),
    # both: what runs ahead of time never delays a decode step, and decode steps read plain KV
    "kvcmas-idle-copy": Method("kvcmas-idle-copy", "kvcmas", prefetch="idle", decode_copy="auto"),
    # ours with every side factored, small corrections too (StorageSpec.small_rows=False): the ablation
    "kvcmas-svd": Method("kvcmas-svd", "kvcmas", small_rows=False),
    # ours with the values kept as 4-bit rows (StorageSpec.value_bits): fewer bytes, see README
    "kvcmas-v4": Method("kvcmas-v4", "kvcmas", value_bits=4),
    # ours with keys as 8-bit rows (channel then row scales) and values as 4-bit rows: no SVD at all
    "kvcmas-k8v4": Method("kvcmas-k8v4", "kvcmas", value_bits=4, key_bits=8),
    # ours with keys and values as 4-bit rows (StorageSpec.key_bits, value_bits): no SVD at all
    "kvcmas-kv4": Method("kvcmas-kv4", "kvcmas", value_bits=4, key_bits=4),
    # ours with small corrections' rows in 8 bits (StorageSpec.small_row_bits), the storage before 6-bit rows
    "kvcmas-rows8": Method("kvcmas-rows8", "kvcmas", small_row_bits=8),
    # ours with U's leading components in 8 bits and every layer from 1 stored (StorageSpec.u_head_bits,
    # uncorrected_energy): the storage defaults before 6-bit U codes and faint layers
    "kvcmas-u8": Method("kvcmas-u8", "kvcmas", u_head_bits=8, uncorrected_energy=0.0),
    # ours storing every layer from 1 on (StorageSpec.uncorrected_energy=0)
    "kvcmas-all-layers": Method("kvcmas-all-layers", "kvcmas", uncorrected_energy=0.0),
    # ours with the storage defaults before 4-bit tails: U all in int8, B in bf16 (the comparison)
    "kvcmas-int8": Method("kvcmas-int8", "kvcmas", correction_dtype="int8", u8_components="all", u_head_bits=8),
}
DEFAULT_METHODS: tuple[str, ...] = tuple(METHODS)


def sweep_methods(ratios: tuple[float, ...], ranks: tuple[int, ...], prefetch_ratios: tuple[float, ...] = (),
                  no_prefetch: bool = False) -> list[Method]:
    """kvcmas over recompute_ratio, over rank, over prefetch_ratio (each with the other knobs at their
    defaults), and optionally without ahead-of-time corrections."""
    out = [Method("kvcmas", "kvcmas", recompute_ratio=r) for r in ratios]
    out += [Method("kvcmas", "kvcmas", rank=k) for k in ranks]
    out += [Method("kvcmas", "kvcmas", prefetch_ratio=p) for p in prefetch_ratios]
    if no_prefetch:
        out.append(Method("kvcmas", "kvcmas", prefetch=False))
    return out
