"""The exact pass: run a scenario with ``reuse="none"`` and record every turn's greedy continuation."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from ..engine import Engine, ReuseOptions, SamplingParams
from .scenarios import MODERATOR, History, Scenario, prompt_messages

EXACT = ReuseOptions(reuse="none")


@dataclass
class ExactTurn:
    """One agent turn of the exact run.

    tokens: the evaluated exact continuation: the first ``eval_tokens`` greedy tokens, plus the stop
        token when the reply ended inside that window (so agreement also covers stopping).
    logits: [len(tokens), vocab] fp32; row i predicts tokens[i] given the prompt and tokens[:i]
        (greedy decoding is teacher forcing on its own output).
    """

    index: int
    round: int
    group: int
    agent: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    shared_tokens: int          # prompt tokens every agent has in common (task + replies)
    reply: str
    reply_tokens: int
    finish_reason: str
    tokens: list[int]
    logits: torch.Tensor
    reply_ids: list[int] = field(default_factory=list)    # every generated token (the whole reply)

    def to_dict(self) -> dict:
        return {"index": self.index, "round": self.round, "group": self.group, "agent": self.agent,
                "prompt_tokens": self.prompt_tokens, "shared_tokens": self.shared_tokens,
                "reply_tokens": self.reply_tokens, "finish_reason": self.finish_reason,
                "eval_tokens": len(self.tokens), "reply": self.reply}


def evaluated_tokens(token_ids: list[int], logits: list[torch.Tensor], finish_reason: str,
                     eval_tokens: int) -> list[int]:
    """The greedy tokens to evaluate, with the stop token appended when the reply stopped in the window."""
    tokens = list(token_ids)
    if finish_reason == "stop" and len(logits) > len(tokens):
        tokens.append(int(logits[len(tokens)].argmax()))      # greedy chose it, so it is the argmax
    return tokens[:eval_tokens]


async def run_exact(engine: Engine, scenario: Scenario, reply_tokens: int, eval_tokens: int) -> list[ExactTurn]:
    """Play the scenario with exact prefill and greedy replies; a turn group runs concurrently."""
    history: History = []
    turns: list[ExactTurn] = []
    sampling = SamplingParams(max_tokens=reply_tokens, return_logits=True)
    for group, (rnd, agents, handoff) in enumerate(scenario.schedule()):
        history.append((MODERATOR, handoff))
        prompts = [prompt_messages(scenario, a, history) for a in agents]
        outs = await asyncio.gather(*(engine.generate(p, agent=a, sampling=sampling, reuse_options=EXACT)
                                      for a, p in zip(agents, prompts)))
        for agent, messages, out in zip(agents, prompts, outs):
            tokens = evaluated_tokens(out.token_ids, out.logits, out.finish_reason, eval_tokens)
            system_only = engine.count_tokens(messages[:1])        # both counts include the generation prompt
            turns.append(ExactTurn(
                len(turns), rnd, group, agent, messages, out.usage.prompt_tokens,
                out.usage.prompt_tokens - system_only, out.text.strip(), out.usage.completion_tokens,
                out.finish_reason, tokens, torch.stack(out.logits[:len(tokens)]), list(out.token_ids)))
        history += [(a, t.reply) for a, t in zip(agents, turns[-len(agents):])]
    return turns


async def run_exact_and_close(engine: Engine, scenario: Scenario, reply_tokens: int,
                              eval_tokens: int) -> tuple[list[ExactTurn], dict[str, str]]:
    """``run_exact``, then close the engine (also on failure): an idle engine's worker keeps an OpenMP
    team alive, which slows the engines measured after it (EngineConfig.num_threads). Returns the turns
    and what the engine ran on (model name, device, dtype)."""
    try:
        served = {"model_name": engine.model_name, "device_used": str(engine.device),
                  "dtype": str(engine.model.dtype).replace("torch.", "")}
        return await run_exact(engine, scenario, reply_tokens, eval_tokens), served
    finally:
        await engine.aclose()
