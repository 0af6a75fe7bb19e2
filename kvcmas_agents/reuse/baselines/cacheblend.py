"""CacheBlend baseline (Yao et al. 2024, "CacheBlend: Fast Large Language Model Serving for RAG with
Cached Knowledge Fusion"), written from the paper's description on this engine's primitives.

Per request of agent X, for the spans reused from other agents' home views:
  1. copy the home KV into X's own blocks, keys RoPE-realigned to X's positions (as naive reuse);
  2. run layers 0 and 1 for every reused token under X's context (X's exact prefix + the copy), writing
     their recomputed KV over the copy at those two layers;
  3. rank the reused tokens by their KV deviation at layer 1 (the "high-KV-deviation" tokens):
     ``||K_new - K_reused||^2 + ||V_new - V_reused||^2`` summed over KV heads, and keep the top
     ``recompute_ratio`` of them (CacheBlendConfig.ratio, default 0.15: the paper's ~15%);
  4. recompute only those tokens in layers 2..L-1 and overwrite their rows: the blended KV.
New text between reused spans is computed at every layer. Nothing persists: the blended copy is the
request's own KV (counted in kv_bytes, freed with it), and every request blends anew.
Usage: reused_tokens = tokens of the reused spans; recomputed_tokens = the selected tokens (layers
0-1 run for all reused tokens, i.e. 2/L of a full prefill of them, and are not counted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import ReuseRequest
from ..registry import register
from .private_view import PrivateCopyMethod, span_positions

BLEND_LAYER = 1   # the layer whose KV deviation selects the tokens (CacheBlend's choice)


@dataclass(frozen=True)
class CacheBlendConfig:
    """ratio: share of reused tokens recomputed past the blend layer (the paper's ~15%); a request's
    explicit ReuseOptions.recompute_ratio overrides it."""

    ratio: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"cacheblend ratio must be in [0, 1], got {self.ratio}")


@register
class CacheBlend(PrivateCopyMethod):
    name = "cacheblend"
    config_class = CacheBlendConfig

    @classmethod
    def defaults(cls, config) -> tuple[float, int, str]:
        _, rank, reference = super().defaults(config)
        return cls.settings_of(config).ratio, rank, reference

    @torch.inference_mode()
    def prepare(self, req: ReuseRequest) -> None:
        st = self.states(req)
        pending = [p for p in st.pieces if p.pending and p.home is not None]
        new = [p for p in st.pieces if p.home is None]
        self.copy_realigned(req, pending)
        dev = self.ctx.device
        reused, fresh = span_positions(pending, dev), span_positions(new, dev)
        positions, order = torch.cat([reused, fresh]).sort()
        is_reused = order < reused.numel()
        keep_reused = round(req.options.recompute_ratio * reused.numel())
        blend_layer = min(BLEND_LAYER, self.ctx.model.args.num_layers - 1)

        def select(layer, pos, k_old, v_old, k_new, v_new):
            if layer != blend_layer:
                return None
            dev_kv = ((k_new.float() - k_old.float()).pow(2).sum((1, 2))
                      + (v_new.float() - v_old.float()).pow(2).sum((1, 2)))
            score = torch.where(is_reused, dev_kv, torch.full_like(dev_kv, float("inf")))  # new text: always
            return torch.topk(score, keep_reused + fresh.numel()).indices.sort().values

        self.recompute_rows(req, st, positions, select)
        for p in pending + new:
            p.pending = False
        req.recomputed_tokens += keep_reused

    def stats(self) -> dict:
        return {"ratio": self.settings.ratio}
