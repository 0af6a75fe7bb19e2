"""OpenAI's frequency/presence penalties and logit bias, applied to the rows of a batch that set them.

For token j generated c[j] times so far in the request:
``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, then ``logit[j] += bias[j]``.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch


class AdjustSettings(Protocol):
    frequency_penalty: float
    presence_penalty: float
    logit_bias: Mapping[int, float] | None


def needs_adjust(p: AdjustSettings) -> bool:
    return bool(getattr(p, "frequency_penalty", 0.0) or getattr(p, "presence_penalty", 0.0)
                or getattr(p, "logit_bias", None))


def adjust_rows(x: torch.Tensor, rows: list[int], params: Sequence[AdjustSettings],
                histories: Sequence[Sequence[int]] | None) -> None:
    """Penalise and bias rows ``rows`` of fp32 logits ``x`` [B, V] in place."""
    vocab = x.shape[-1]
    for i in rows:
        p = params[i]
        freq, pres = float(p.frequency_penalty or 0.0), float(p.presence_penalty or 0.0)
        history = histories[i] if histories is not None else ()
        if (freq or pres) and len(history):
            ids = torch.as_tensor(list(history), dtype=torch.long, device=x.device)
            counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(x.dtype)
            x[i] -= counts * freq + (counts > 0).to(x.dtype) * pres
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=x.device)
            vals = torch.tensor([float(v) for v in p.logit_bias.values()], dtype=x.dtype, device=x.device)
            x[i].index_add_(0, ids, vals)
