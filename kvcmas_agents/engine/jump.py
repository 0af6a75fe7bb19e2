"""Jump-forward decoding: what a request's grammar forces is appended at once, without sampling it.

The fixed parts of a constrained reply (``<tool_call>{"name": "add", "arguments": {"a": `` of a
forced call, a schema's property names, ``}</tool_call>``) have exactly one continuation. They go
into the output together, and the scheduler feeds them to the model as one chunk in the next step
(``Scheduler.schedule``), instead of one forward and one sampled token each.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .request import Request


@dataclass
class Jump:
    """What one jump appended, and the finish reason it reached (None: the request goes on)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def jump_forward(req: Request, tok_lock: threading.Lock) -> Jump:
    """Append the tokens ``req``'s grammar forces now; a request whose output cannot grow ends ("stop"),
    one that reaches ``max_new_tokens`` ends ("length"), a stop string in the forced text ends it too."""
    jump = Jump()
    grammar = req.grammar
    if grammar is None:
        return jump
    for tok in grammar.forced():
        if not grammar.accept(tok):       # cannot happen for xgrammar's own tokens; sample instead
            break
        req.output_ids.append(tok)
        jump.token_ids.append(tok)
        with tok_lock:
            jump.text += req.detok.push(tok)
        if req.detok.stopped:
            req.stop_reason = req.detok.matched_stop
            jump.finish_reason = "stop"
            return jump
        if len(req.output_ids) >= req.max_new_tokens:
            jump.finish_reason = "length"
            return jump
    if grammar.ended:     # only a stop token could follow: end here rather than sample it
        jump.finish_reason = "stop"
    return jump
