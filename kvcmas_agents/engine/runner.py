"""Runs one planned step through the model over the paged KV store."""
from __future__ import annotations

from typing import Callable

import torch

from ..cache.kv_store import KVStore
from ..model.llama import LlamaModel
from .paged_attention import PagedAttention, SeqSlice
from .request import Request
from .scheduler import StepItem


class ModelRunner:
    def __init__(self, model: LlamaModel, store: KVStore, view_of: Callable[[Request, int], object]):
        self.model = model
        self.store = store
        self.view_of = view_of        # the request's reuse view of [0, end), or None

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
            view = self.view_of(req, start + n)
            if view is not None:
                slices.append(SeqSlice(offset, offset + n, None, view, positions[-1].to(dev)))
            else:
                slices.append(SeqSlice(offset, offset + n, self.store.slots(req.blocks, 0, start + n)))
            offset += n
            if item.samples:
                rows.append(offset - 1)
        attn = PagedAttention(self.store, slices, torch.cat(write), self.model.scale)
        hidden = self.model.forward(torch.tensor(tokens, device=dev), torch.cat(positions).to(dev), attn)
        if not rows:
            return hidden.new_empty((0, self.model.args.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(rows, device=dev)])
