"""Per-token logprobs as the engine hands them out (``RequestOutput.logprobs``, ``StreamDelta.logprobs``).

Each entry is a generated token (the end-of-sequence token that stops a request is not one): its logprob
under the processed logits it was sampled from (model/logprobs.py says which) and the ``top_logprobs``
most likely alternatives at that step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..chat.token_bytes import TokenTexts
from ..model.logprobs import TokenLogprobs


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    bytes: list[int]


@dataclass
class Logprob:
    """One generated token's logprob; ``top_logprobs`` best first."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = field(default_factory=list)


def logprob_entry(raw: TokenLogprobs, texts: TokenTexts) -> Logprob:
    """The entry for a sampler's ``TokenLogprobs``, with token texts and bytes."""
    def top(tok: int, lp: float) -> TopLogprob:
        text, raw_bytes = texts(tok)
        return TopLogprob(tok, text, lp, raw_bytes)

    text, raw_bytes = texts(raw.token_id)
    return Logprob(raw.token_id, text, raw.logprob, raw_bytes, [top(t, lp) for t, lp in raw.top])
