"""Replay an exact conversation under one reuse mode, teacher-forced on the exact continuations."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import groupby

from ..engine import Engine, RequestOutput, SamplingParams
from .conversation import ExactTurn
from .metrics import TurnMetrics, turn_metrics


@dataclass
class ReplayTurn:
    """One agent turn under a reuse mode: fidelity against the exact turn, and where its KV came from."""

    index: int
    round: int
    group: int
    agent: str
    metrics: TurnMetrics
    prompt_tokens: int
    cached_tokens: int           # exact reuse (the agent's own earlier context)
    reused_tokens: int           # from other agents' views
    recomputed_tokens: int
    served: str                  # the reuse mode that actually served the request
    ttft_s: float
    timings: dict[str, float] = field(default_factory=dict)   # where the TTFT went (RequestOutput.timings)
    decode_s: float = 0.0        # from the first token to the last
    decoded_tokens: int = 0      # tokens after the first

    @property
    def reused_frac(self) -> float:
        return self.reused_tokens / self.prompt_tokens

    @property
    def not_prefilled_frac(self) -> float:
        """Prompt tokens served from any cache (exact or reused), not prefilled."""
        return (self.reused_tokens + self.cached_tokens) / self.prompt_tokens

    @property
    def recomputed_frac(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens

    def to_dict(self) -> dict:
        return {"index": self.index, "round": self.round, "group": self.group, "agent": self.agent,
                **self.metrics.to_dict(), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "reused_tokens": self.reused_tokens,
                "recomputed_tokens": self.recomputed_tokens, "reused_frac": self.reused_frac,
                "not_prefilled_frac": self.not_prefilled_frac, "recomputed_frac": self.recomputed_frac,
                "served": self.served, "ttft_s": self.ttft_s, "timings": self.timings, "decode_s": self.decode_s,
                "decoded_tokens": self.decoded_tokens}


def _turn(exact: ExactTurn, out: RequestOutput, n: int) -> ReplayTurn:
    u = out.usage
    return ReplayTurn(exact.index, exact.round, exact.group, exact.agent,
                      turn_metrics(exact.logits[:n], out.logits, exact.tokens[:n]),
                      u.prompt_tokens, u.cached_tokens, u.reused_tokens, u.recomputed_tokens, out.reuse, out.ttft_s,
                      dict(out.timings), out.latency_s - out.ttft_s, max(u.completion_tokens - 1, 0))


def forced_tokens(t: ExactTurn, eval_tokens: int, full_decode: bool) -> list[int]:
    """What a replayed turn decodes: the evaluated window, or the whole exact reply (and the stop token
    when the window evaluates it), as the agent really would."""
    window = t.tokens[:eval_tokens]
    if not full_decode or len(t.reply_ids) <= len(window):
        return window
    return list(t.reply_ids)


async def replay(engine: Engine, turns: list[ExactTurn], eval_tokens: int,
                 full_decode: bool = False) -> list[ReplayTurn]:
    """Run every turn's exact prompt in order on ``engine``, forcing the exact continuation.

    Fidelity is scored on the first ``eval_tokens``. With ``full_decode`` each turn decodes its whole
    exact reply, as a real agent does: its decode KV then exists for later agents (decoded home views),
    and ahead-of-time corrections get the decode's duration to run. The engine must be fresh (or its
    agents unseen): cross-agent state built by earlier turns is part of what is measured. A turn group
    runs concurrently, as in the exact pass.
    """
    results: list[ReplayTurn] = []
    for _, group in groupby(turns, key=lambda t: t.group):
        group = list(group)

        async def one(t: ExactTurn) -> ReplayTurn:
            forced = forced_tokens(t, eval_tokens, full_decode)
            sampling = SamplingParams(max_tokens=len(forced), return_logits=True, forced_tokens=forced)
            out = await engine.generate(t.messages, agent=t.agent, sampling=sampling)
            return _turn(t, out, min(len(forced), len(t.tokens[:eval_tokens])))

        results += await asyncio.gather(*(one(t) for t in group))
    return results
