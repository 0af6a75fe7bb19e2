"""Fidelity metrics of a reuse mode against the exact run: KL of next-token distributions, agreement."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch


def kl_steps(ref_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(P_ref || P_other) in nats for logits shaped [..., vocab]."""
    # float64: the KLs we care about are ~1e-4..1e-6, a sum over 49k vocab entries.
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(other_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def kl(ref_logits: torch.Tensor, other_logits: torch.Tensor) -> float:
    """KL(P_ref || P_other) in nats between two fp32 logit vectors of one step."""
    return float(kl_steps(ref_logits, other_logits))


def _stack(logits: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    return logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))


@dataclass
class TurnMetrics:
    """One agent turn under teacher forcing on the exact greedy continuation.

    first_token_kl: KL at step 0 (prompt only).
    tf_kl_mean: mean KL over the evaluated continuation.
    matched: leading steps where the mode's argmax equals the exact token, i.e. how long free-running
        greedy decoding under the mode would agree with the exact reply.
    agreement: matched / length.
    break_gap: at the first mismatched step, the exact run's top-1 minus top-2 logit (how near a tie
        the exact choice was); None when every step matched.
    """

    first_token_kl: float
    tf_kl_mean: float
    agreement: float
    matched: int
    length: int
    tf_kl_max: float = 0.0
    step_kl: list[float] = field(default_factory=list)
    break_gap: float | None = None

    def truncate(self, n: int) -> "TurnMetrics":
        """The same metrics over the first n steps only."""
        steps = self.step_kl[:n]
        length = min(self.length, n)
        matched = min(self.matched, length)
        return TurnMetrics(steps[0] if steps else 0.0, sum(steps) / len(steps) if steps else 0.0,
                           matched / length if length else 1.0, matched, length, max(steps, default=0.0), steps,
                           self.break_gap if matched < length else None)

    def to_dict(self) -> dict:
        return asdict(self)


def turn_metrics(exact_logits: Sequence[torch.Tensor] | torch.Tensor,
                 mode_logits: Sequence[torch.Tensor] | torch.Tensor,
                 exact_tokens: Sequence[int]) -> TurnMetrics:
    """Compare a mode's teacher-forced logits with the exact ones over the exact greedy tokens."""
    n = len(exact_tokens)
    if n == 0:
        raise ValueError("no exact tokens to evaluate")
    ref, other = _stack(exact_logits), _stack(mode_logits)
    if len(ref) < n or len(other) < n:
        raise ValueError(f"need {n} steps of logits, got exact {len(ref)} and mode {len(other)}")
    steps = kl_steps(ref[:n], other[:n]).tolist()
    hits = (other[:n].argmax(-1) == torch.as_tensor(list(exact_tokens))).tolist()
    matched = hits.index(False) if False in hits else n
    gap = None
    if matched < n:
        top2 = ref[matched].float().topk(2).values
        gap = float(top2[0] - top2[1])
    return TurnMetrics(steps[0], sum(steps) / n, matched / n, matched, n, max(steps), steps, gap)
