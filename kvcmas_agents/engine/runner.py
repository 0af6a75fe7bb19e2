"""Runs one planned step through the model over the paged KV store."""
from __future__ import annotations

import torch

from .attention import PagedAttention, SeqSlice
from .correction import Corrector
from .view_pack import pack_view, resolve_view_path, self_check
from .kv_store import KVStore
from .model import LlamaModel
from .scheduler import StepItem


class ModelRunner:
    def __init__(self, model: LlamaModel, store: KVStore, corrector: Corrector | None = None,
                 view_path: str = "auto"):
        # "gather" (fast torch path), "query" (view_attention) or "triton" (the fused kernel).
        self.view_path = resolve_view_path(view_path, model.device)
        self.model = model
        self.store = store
        self.corrector = corrector
        self.view_fallback: str | None = None
        if view_path == "auto" and self.view_path == "triton" and corrector is not None:
            a = model.args
            self.view_fallback = self_check(corrector.realigner, a.num_kv_heads, a.num_heads, a.head_dim,
                                            model.device, store.k.dtype)
            if self.view_fallback is not None:
                self.view_path = "gather"

    @torch.inference_mode()
    def run(self, items: list[StepItem]) -> torch.Tensor:
        """Forward the step's tokens; returns fp32 logits [n_sampling, vocab], one row per
        item whose chunk reaches the end of its tokens, in item order."""
        dev = self.model.device
        tokens, positions, write, slices, rows = [], [], [], [], []
        offset = 0
        for item in items:
            req, n = item.request, item.num_tokens
            start = req.num_computed
            tokens.extend(req.all_ids[start:start + n])
            positions.append(torch.arange(start, start + n))
            write.append(self.store.slots(req.blocks, start, start + n))
            if req.pieces and self.corrector is not None and start + n > req.own_prefix_end:
                pieces, view = None, None
                if self.view_path == "gather":
                    view = self.corrector.gathered_view(req, start + n)
                else:
                    pieces = self.corrector.pieces_for(req, start + n)
                    if self.view_path == "triton":
                        view = pack_view(pieces, self.corrector.realigner, dev)
                slices.append(SeqSlice(offset, offset + n, start + n, None, pieces, positions[-1].to(dev), view))
            else:
                gather = self.store.slots(req.blocks, 0, start + n)
                slices.append(SeqSlice(offset, offset + n, start + n, gather))
            offset += n
            if item.samples:
                rows.append(offset - 1)
        attn = PagedAttention(self.store, slices, torch.cat(write), self.model.scale,
                              self.corrector.realigner if self.corrector is not None else None)
        hidden = self.model.forward(torch.tensor(tokens, device=dev), torch.cat(positions).to(dev), attn)
        if not rows:
            return hidden.new_empty((0, self.model.args.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(rows, device=dev)])
