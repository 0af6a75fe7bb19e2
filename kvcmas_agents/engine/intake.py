"""Request intake on the caller's thread: a chat request checked, rendered and sized into a ``Request``
before it reaches the worker, so bad input fails in the caller with the engine's own errors."""
from __future__ import annotations

import itertools
import math
import threading
import uuid
from typing import Any

import torch

from ..chat.detokenize import IncrementalDetokenizer
from ..chat.template import ChatFormatter, RenderedPrompt
from ..errors import InvalidRequestError
from ..model.args import ModelArgs
from ..model.grammar import Grammars
from ..model.sampling import make_generator
from ..reuse import ReuseOptions, method_class
from .config import EngineConfig, SamplingParams
from .constraints import grammar_spec
from .request import Request
from .scheduler import Scheduler
from .stats import Counters
from .tool_decision import TEXT_ANSWER


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Intake:
    """Makes requests for one engine from its parts (all given here, none patched in later)."""

    def __init__(self, config: EngineConfig, args: ModelArgs, formatter: ChatFormatter, tokenizer: Any,
                 tok_lock: threading.Lock, grammars: Grammars, scheduler: Scheduler, counters: Counters,
                 max_context: int, device: torch.device, realign_refused: bool):
        self.config, self.args, self.formatter, self.tokenizer = config, args, formatter, tokenizer
        self.tok_lock, self.grammars, self.scheduler, self.counters = tok_lock, grammars, scheduler, counters
        self.max_context, self.device, self.realign_refused = max_context, device, realign_refused
        self.ids = itertools.count()

    def make(self, messages: Any, agent: str, sampling: SamplingParams | None, tools: list[dict] | None,
             tool_choice: Any, request_id: str | None, sink: Any, reuse_options: ReuseOptions | None = None
             ) -> Request:
        """A checked request, or InvalidRequestError / ContextLengthError naming what is wrong."""
        if not isinstance(agent, str) or not agent:
            raise InvalidRequestError("agent must be a non-empty string")
        sampling = SamplingParams() if sampling is None else sampling
        options = ReuseOptions() if reuse_options is None else reuse_options
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if not isinstance(options, ReuseOptions):
            raise InvalidRequestError(f"reuse_options must be a ReuseOptions or None, got {type(options).__name__}")
        try:
            sampling.validate()
            sampling.check_vocab(self.args.vocab_size)
            options.validate()
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(str(exc)) from exc
        options = options.resolve(self.config)
        if method_class(options.reuse).cross_agent and self.realign_refused:
            options.reuse = "prefix"       # cannot realign this rope scaling; counted in stats
            self.counters.add("realign_refusals")
        with self.tok_lock:
            prompt = self.formatter.render(messages, tools, tool_choice=tool_choice)
            detok = IncrementalDetokenizer(self.tokenizer, sampling.stop, prompt.token_ids)
        max_new = min(sampling.max_tokens, self.max_context - len(prompt.token_ids))
        req = Request(request_id=request_id or f"req-{next(self.ids)}-{uuid.uuid4().hex[:8]}", agent=agent,
                      prompt=prompt, sampling=sampling, max_new_tokens=max_new, detok=detok, sink=sink,
                      generator=make_generator(sampling.seed, self.device) if sampling.temperature > 0 else None,
                      options=options)
        if tools:
            req.tool_names = {t.get("function", t).get("name") for t in tools if isinstance(t, dict)}
        spec = grammar_spec(sampling.response_format, tools, tool_choice)
        if spec is not None:
            if sampling.ignore_eos or sampling.forced_tokens is not None:
                raise InvalidRequestError("constrained output (response_format or a forced tool_choice) cannot "
                                          "be combined with ignore_eos or forced_tokens")
            req.grammar = self.grammars.state(spec)
        need = self.scheduler.blocks.blocks_for(req.max_total_tokens)
        if need > self.scheduler.store.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({len(prompt.token_ids)} prompt + {max_new} new tokens) but "
                f"kv_budget_bytes={self.config.kv_budget_bytes} holds only {self.scheduler.store.num_blocks}")
        return req

    def decided(self, req: Request, call: bool | None) -> None:
        """A reply the decision step made a text answer may not open a call (``TEXT_ANSWER``)."""
        sampling = req.sampling
        if call is False and req.grammar is None and not sampling.ignore_eos and sampling.forced_tokens is None:
            req.grammar = self.grammars.state(TEXT_ANSWER)


def side_request(request_id: str, agent: str, prompt: RenderedPrompt, options: ReuseOptions) -> Request:
    """A request the worker plans and prepares but never admits (work ahead of time)."""
    return Request(request_id=request_id, agent=agent, prompt=prompt, sampling=SamplingParams(max_tokens=1),
                   max_new_tokens=1, detok=None, sink=lambda event: None, options=options)
