"""The one layer-by-layer recompute loop that every correcting method runs.

Chosen prompt tokens are recomputed under the request's own context: at each layer their new keys
and values replace their rows in the context, and they attend, causally, over that context. What the
context is (a corrected view gathered per layer, or the request's own blocks) and what happens to the
new rows (kept as deviations, written to blocks, used to narrow the rows) is the caller's.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..model.attention import rows_attention
from ..model.llama import LlamaModel

# context(layer) -> (keys, values) [N, KVH, D] of positions [0, N), a fresh tensor the loop may write.
Context = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# hook(layer, positions [T], k_old, v_old, k_new, v_new) -> indices into positions to keep computing in
# the following layers, or None to keep all. k_old/v_old are the rows' KV in the context before the
# new KV replaces them.
LayerHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     "torch.Tensor | None"]


@torch.inference_mode()
def recompute(model: LlamaModel, token_ids: torch.Tensor, positions: torch.Tensor, context: Context,
              hook: LayerHook | None = None) -> None:
    """Recompute the tokens at sorted ``positions`` (``token_ids`` holds the whole prompt) layer by layer.

    At each layer the rows' new KV replaces theirs in the context before attention, so they see each
    other's new KV and every other position's context KV. A hook may narrow the rows for the
    following layers; rows it drops keep the KV computed so far. Within ``model.products(dtype)`` the
    rows' projections and attention take their inputs in that dtype.
    """
    pos = positions.to(model.device)
    if pos.numel() == 0:
        return
    h = model.embed(token_ids.to(model.device)[pos])
    for layer in range(model.args.num_layers):
        q, k, v = model.qkv(layer, h, pos)
        kk, vv = context(layer)
        keep = hook(layer, pos, kk[pos], vv[pos], k, v) if hook is not None else None
        kk[pos], vv[pos] = k, v
        if keep is not None:
            q, h, pos = q[keep], h[keep], pos[keep]
            if pos.numel() == 0:
                return
        h = model.finish_layer(layer, h, rows_attention(q, kk, vv, pos, model.scale, dtype=model.wide_dtype))
