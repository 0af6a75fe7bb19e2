"""Grammar-constrained decoding on xgrammar: compiled grammars, per-request matchers, logits masks.

A ``GrammarSpec`` (a JSON schema, optionally between literal prefix and suffix text) compiles once
per tokenizer into an xgrammar ``CompiledGrammar``, cached by its canonical JSON. Each constrained
request owns a ``GrammarState`` (an xgrammar matcher) that the sampler asks for the allowed tokens
and the worker advances with every accepted token. xgrammar is imported on first use, so engines
that never constrain a request never load it.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import InvalidRequestError

_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    """Output that is ``prefix``, then one JSON value valid against ``schema`` (or text matching
    ``regex``), then ``suffix``.

    ``schema`` is compact JSON text (``GrammarSpec.of`` builds it), the cache key. Key order is kept:
    it is the order in which the properties are generated.
    """

    schema: str
    prefix: str = ""
    suffix: str = ""
    regex: str = ""          # when set, the output is this regular expression instead of JSON

    @classmethod
    def pattern(cls, regex: str) -> "GrammarSpec":
        return cls("", regex=regex)

    @classmethod
    def of(cls, schema: Any, prefix: str = "", suffix: str = "") -> "GrammarSpec":
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"JSON schema is not JSON-serializable: {exc}") from exc
        return cls(text, prefix, suffix)


class GrammarState:
    """One request's position in its grammar (not thread-safe; the worker owns it while it runs)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (an xgrammar int32 bitmask)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it (state unchanged)."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def completed(self) -> bool:
        """The output so far is a complete match (a stop token may follow)."""
        return bool(self._matcher.is_completed())

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward), not yet accepted; [] when
        the model has a choice. xgrammar leaves out a last token that could be the start of a longer one."""
        return list(self._matcher.find_jump_forward_tokens())

    @property
    def ended(self) -> bool:
        """Complete, with nothing but a stop token allowed next: the output cannot grow."""
        if not self._matcher.is_completed():
            return False
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        allowed = _bits(mask[0], self._vocab_size)
        return allowed <= set(self._matcher.stop_token_ids)


class Grammars:
    """Compiles ``GrammarSpec``s for one tokenizer, caching the compiled grammars (LRU, thread-safe).

    ``stop_token_ids`` end a completed grammar; ``vocab_size`` is the width of the model's logits.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher at the start of ``spec``; InvalidRequestError when it cannot compile."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)

    def compiled(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return hit
            self.misses += 1
            compiled = self._compile(spec)
            self._cache[spec] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            # Compact JSON (no free whitespace): a small model cannot then stall in endless blanks.
            body = (xgr.Grammar.from_regex(spec.regex) if spec.regex else
                    xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False, strict_mode=True))
            parts = [_literal(xgr, spec.prefix), body, _literal(xgr, spec.suffix)]
            grammar = xgr.Grammar.concat(*[p for p in parts if p is not None])
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[0].split("] ", 1)[-1]   # drop xgrammar's "[time] file:line"
            raise InvalidRequestError(f"cannot constrain output to this JSON schema: {reason}") from exc


def _bits(row: torch.Tensor, vocab_size: int) -> set[int]:
    """The token ids set in one int32 bitmask row."""
    words = row.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") if text else None


def apply_masks(logits: torch.Tensor, rows: list[int], states: Sequence[GrammarState]) -> None:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar forbids.

    Only ``rows`` are read or written; every other row of ``logits`` stays bit-identical.
    """
    import xgrammar as xgr

    batch, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(batch, vocab)      # all allowed
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    backend = "cpu" if logits.device.type == "cpu" else "auto"
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows,
                                    backend=backend)
