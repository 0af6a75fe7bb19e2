"""Answer or call: a decision step that lets a small model use its tools under ``tool_choice="auto"``.

Left to free decoding, SmolLM2-135M never opens a ``<tool_call>`` block, even when the request is
what a tool is for. Yet the probability it gives to opening its reply with ``<tool_call>`` (the
tag's five tokens, teacher-forced) separates the two: measured on 36 requests, every request a tool
was meant for scored above -9.5 without a system prompt, most plain questions below -10
(docs/tool_calls.md). The decision step scores that opening in a short request of its own; above
``threshold`` the reply becomes a grammar-constrained call of one of the tools
(``tool_choice="required"``), else a text answer (constrained only not to open with ``<``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import InvalidRequestError
from ..model.grammar import GrammarSpec
from .config import SamplingParams
from .outputs import RequestOutput

DEFAULT_THRESHOLD = -10.0
# An answer the step chose may not open with a tag: after a tool result the model would repeat its call.
TEXT_ANSWER = GrammarSpec.pattern(r"[^<][\s\S]*")


@dataclass
class ToolDecision:
    """When a ``tool_choice="auto"`` request with tools is answered by a (constrained) call.

    threshold: natural-log probability of the reply opening with ``<tool_call>`` above which it calls.
    after_tool_result: decide also when the last message is a tool result; by default such a turn is
        answered in text (the model otherwise calls again: it scores high after every call it made).
    """

    threshold: float = DEFAULT_THRESHOLD
    after_tool_result: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold):
            raise InvalidRequestError(f"ToolDecision.threshold must be a finite number, got {self.threshold!r}")

    @staticmethod
    def applies(tools: Any, tool_choice: Any) -> bool:
        """True for a request the step decides: tools, and ``tool_choice`` auto (or unset)."""
        return bool(tools) and tool_choice in (None, "auto")

    def scores(self, messages: Any) -> bool:
        """Whether to score the call (else answer): not after a tool result, unless ``after_tool_result``."""
        last = messages[-1] if isinstance(messages, (list, tuple)) and messages else None
        return self.after_tool_result or not (isinstance(last, dict) and last.get("role") == "tool")

    @staticmethod
    def scoring(open_ids: Sequence[int]) -> SamplingParams:
        """The scoring request's sampling: the call tag teacher-forced, with each step's logits."""
        return SamplingParams(max_tokens=len(open_ids), forced_tokens=list(open_ids), return_logits=True)

    @staticmethod
    def score(out: RequestOutput, open_ids: Sequence[int]) -> float:
        """Log probability of the tag from the scoring request's logits (-inf if it was cut short)."""
        logits = out.logits or []
        if len(logits) < len(open_ids):
            return -math.inf
        return float(sum(torch.log_softmax(step.float(), -1)[tok] for step, tok in zip(logits, open_ids)))

    def calls(self, score: float) -> bool:
        """True: the reply is a constrained call (``tool_choice="required"``); else a text answer."""
        return score > self.threshold
