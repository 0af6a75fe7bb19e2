"""Log-probabilities of sampled tokens, taken from the logits each token was drawn from.

They are ``log_softmax`` of the processed logits: after penalties, logit bias, the grammar mask and
the temperature (1 for greedy rows), before top-k / top-p truncation. Forbidden tokens have -inf.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprobs:
    """One generated token's logprob and its ``top`` alternatives as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class StepLogprobs:
    """The log-softmax rows of one sampling step, for the batch rows that asked for logprobs."""

    def __init__(self, rows: list[int], logp: torch.Tensor, tokens: torch.Tensor, top_k: list[int]):
        self._index = {row: n for n, row in enumerate(rows)}
        self._logp, self._k = logp, top_k
        # One device-to-host copy for the whole step: chosen logprobs and the top-k alternatives.
        chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1)
        k = max(top_k, default=0)
        if k:
            values, ids = torch.topk(logp, k, dim=-1)
            values, ids = values.cpu().tolist(), ids.cpu().tolist()
        else:
            values = ids = [[] for _ in rows]
        self._chosen = list(zip(tokens.cpu().tolist(), chosen.cpu().tolist()))
        self._top = [list(zip(i[:kk], v[:kk])) for i, v, kk in zip(ids, values, top_k)]

    def get(self, row: int, token: int | None = None) -> TokenLogprobs | None:
        """Row ``row``'s entry (None when it did not ask); ``token`` overrides the sampled token."""
        n = self._index.get(row)
        if n is None:
            return None
        tok, lp = self._chosen[n]
        if token is not None and token != tok:
            tok, lp = token, float(self._logp[n, token])
        return TokenLogprobs(int(tok), float(lp), self._top[n])
