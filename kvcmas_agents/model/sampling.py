"""Next-token selection: penalties and logit bias, greedy, temperature, top-k and top-p sampling, and the
sampled tokens' logprobs."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from .grammar import GrammarState, apply_masks
from .logit_adjust import adjust_rows, needs_adjust
from .logprobs import StepLogprobs


class SamplingSettings(Protocol):
    """What the sampler reads of a request's sampling settings (engine.config.SamplingParams)."""

    temperature: float
    top_p: float
    top_k: int
    frequency_penalty: float
    presence_penalty: float
    logit_bias: Mapping[int, float] | None
    logprobs: bool
    top_logprobs: int

# Dividing by a near-zero temperature can overflow fp32 logits to inf (then NaN in softmax).
_MIN_TEMPERATURE = 1e-6


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """Return a per-request generator on ``device``.

    A ``None`` seed gets a generator seeded from ``os.urandom``, so every sampled request still
    owns its RNG stream and never touches (or depends on) the global torch RNG.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def _needs_filter(p: SamplingSettings, vocab: int) -> bool:
    return (0 < p.top_k < vocab) or p.top_p < 1.0


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Apply top-k then top-p to temperature-scaled logits [N, V].

    Returns (probs over the descending-sorted vocab, the sort indices). top_k <= 0 or top_p >= 1
    disable the respective filter for that row.
    """
    # Stable sort so ties rank the same way every time, keeping seeded sampling reproducible.
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))

    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; rank 0 has zero mass
    # before it, so the top token always survives.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    p = top_p.unsqueeze(1)
    drop = (mass_before >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.softmax(sorted_logits, dim=-1), sorted_idx


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Draw one index ([1] int64, on ``probs``' device) with ``gen`` (global RNG when None)."""
    if gen is not None and gen.device != probs.device:
        # Sample where the generator lives rather than fail on a device mismatch.
        return torch.multinomial(probs.to(gen.device), 1, generator=gen).to(probs.device)
    return torch.multinomial(probs, 1, generator=gen)


@dataclass
class SampleResult:
    """A step's next tokens ([B] int64, CPU) and, for rows that asked, their logprobs."""

    tokens: torch.Tensor
    logprobs: StepLogprobs | None = None


class Sampler:
    """Turns a batch of last-token logits into next token ids, one set of sampling settings per row.

    Rows with temperature 0 take ``argmax`` of the fp32 logits. Other rows divide by the
    temperature, apply top-k, then top-p, and draw with ``torch.multinomial`` using the row's own
    generator (``None`` falls back to the global torch RNG). A row's result depends only on its
    own logits, params and generator, never on the rest of the batch.

    Rows with a grammar state first have the tokens their grammar forbids masked to -inf (on a
    copy: ``logits`` is never written); a batch without one skips this step entirely.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingSettings],
        generators: list[torch.Generator | None],
        grammars: Sequence[GrammarState | None] | None = None,
        histories: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Return next token ids as a [B] int64 CPU tensor for ``logits`` of shape [B, V]."""
        return self.sample(logits, params, generators, grammars, histories).tokens

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingSettings],
        generators: list[torch.Generator | None],
        grammars: Sequence[GrammarState | None] | None = None,
        histories: Sequence[Sequence[int]] | None = None,
    ) -> SampleResult:
        """Next tokens for ``logits`` [B, V]; ``histories`` are the tokens each row generated so far
        (what penalties count)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(f"need one params and one generator per row: {batch} rows, "
                             f"{len(params)} params, {len(generators)} generators")
        if grammars is not None and len(grammars) != batch:
            raise ValueError(f"need one grammar (or None) per row: {batch} rows, {len(grammars)} grammars")
        if histories is not None and len(histories) != batch:
            raise ValueError(f"need one history per row: {batch} rows, {len(histories)} histories")
        x = logits.float()
        adjusted = [i for i, p in enumerate(params) if needs_adjust(p)]
        constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
        if (adjusted or constrained) and x is logits:
            x = x.clone()          # ``logits`` is never written
        if adjusted:
            adjust_rows(x, adjusted, params, histories)
        if constrained:
            apply_masks(x, constrained, [grammars[i] for i in constrained])
        out = torch.argmax(x, dim=-1)

        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            self._draw_rows(x, out, sampled, params, generators)
        return SampleResult(out.cpu(), self._logprobs(x, out, params))   # one host copy for the tokens

    @staticmethod
    def _draw_rows(x: torch.Tensor, out: torch.Tensor, sampled: list[int], params: Sequence[SamplingSettings],
                   generators: list[torch.Generator | None]) -> None:
        """Overwrite ``out`` at the rows that sample (temperature > 0) with their draws."""
        vocab = x.shape[-1]
        temps = torch.tensor([max(params[i].temperature, _MIN_TEMPERATURE) for i in sampled],
                             dtype=torch.float32, device=x.device)
        scaled = x[sampled] / temps.unsqueeze(1)

        # Rows without top-k/top-p sample the plain softmax and skip the full-vocab sort.
        filt = [j for j, i in enumerate(sampled) if _needs_filter(params[i], vocab)]
        plain = [j for j, i in enumerate(sampled) if not _needs_filter(params[i], vocab)]
        rows: list[int] = []
        picks: list[torch.Tensor] = []
        if plain:
            probs = torch.softmax(scaled[plain], dim=-1)
            for row, j in enumerate(plain):
                rows.append(sampled[j])
                picks.append(_draw(probs[row], generators[sampled[j]]))
        if filt:
            frows = [sampled[j] for j in filt]
            top_k = torch.tensor([params[i].top_k for i in frows], dtype=torch.long, device=x.device)
            top_p = torch.tensor([params[i].top_p for i in frows], dtype=torch.float32,
                                 device=x.device)
            probs, order = _filtered_probs(scaled[filt], top_k, top_p)
            for row, i in enumerate(frows):
                rows.append(i)
                picks.append(order[row, _draw(probs[row], generators[i])])
        out[torch.tensor(rows, device=x.device)] = torch.cat(picks)

    @staticmethod
    def _logprobs(x: torch.Tensor, out: torch.Tensor, params: Sequence[SamplingSettings]) -> StepLogprobs | None:
        """log_softmax of the processed logits (temperature applied, 1 for greedy rows) of rows asking."""
        rows = [i for i, p in enumerate(params) if getattr(p, "logprobs", False)]
        if not rows:
            return None
        temps = torch.tensor([max(params[i].temperature, _MIN_TEMPERATURE) if params[i].temperature > 0 else 1.0
                              for i in rows], dtype=torch.float32, device=x.device)
        logp = torch.log_softmax(x[rows] / temps.unsqueeze(1), dim=-1)
        return StepLogprobs(rows, logp, out[rows], [int(params[i].top_logprobs or 0) for i in rows])
