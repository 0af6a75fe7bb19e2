"""Grammar-constrained sampling: compiled grammars, masks, and what they leave alone (real tokenizer)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from kvcmas_agents.engine.config import SamplingParams
from kvcmas_agents.errors import InvalidRequestError
from kvcmas_agents.model.grammar import Grammars, GrammarSpec, apply_masks
from kvcmas_agents.model.loader import ensure_safetensors
from kvcmas_agents.model.sampling import Sampler, make_generator

VOCAB = 49152
STOP = 2          # <|im_end|>
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_safetensors(None)[1]))


@pytest.fixture
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB, [STOP])


def _allowed(grammars: Grammars, state) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_masks(logits, [0], [state])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_the_mask_allows_exactly_the_grammar_s_next_tokens(grammars, tokenizer):
    state = grammars.state(GrammarSpec.of(SCHEMA))
    allowed = _allowed(grammars, state)
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    assert tokenizer.convert_tokens_to_ids("{") in allowed
    for tok in tokenizer.encode('{"n": 42}', add_special_tokens=False):
        assert tok in _allowed(grammars, state)
        assert state.accept(tok)
    assert state.completed
    assert _allowed(grammars, state) == {STOP}        # complete: only the stop token may follow
    assert not state.accept(tokenizer.convert_tokens_to_ids("{"))
    assert state.accept(STOP)


def test_prefix_and_suffix_are_literal(grammars, tokenizer):
    state = grammars.state(GrammarSpec.of(SCHEMA, "<tool_call>", "</tool_call>"))
    text = '<tool_call>{"n": 1}</tool_call>'
    assert all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert state.completed
    fresh = grammars.state(GrammarSpec.of(SCHEMA, "<tool_call>", "</tool_call>"))
    assert not fresh.accept(tokenizer.convert_tokens_to_ids("{"))


def test_a_schema_compiles_once_and_is_cached(grammars):
    spec = GrammarSpec.of(SCHEMA)
    a, b = grammars.compiled(spec), grammars.compiled(GrammarSpec.of(json.loads(json.dumps(SCHEMA))))
    assert a is b and (grammars.misses, grammars.hits) == (1, 1)
    grammars.compiled(GrammarSpec.of({"type": "object"}))
    assert grammars.misses == 2


@pytest.mark.parametrize("schema", [{"type": "objectx"}, {"$ref": "#/$defs/missing"}])
def test_a_schema_that_cannot_compile_is_an_invalid_request(grammars, schema):
    with pytest.raises(InvalidRequestError, match="cannot constrain output"):
        grammars.state(GrammarSpec.of(schema))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unconstrained_rows_of_a_mixed_batch_are_bit_identical(grammars, temperature):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2, 3)]

    def gens():
        return [make_generator(p.seed, "cpu") if temperature else None for p in params]

    plain = Sampler()(logits, params, gens())
    state = grammars.state(GrammarSpec.of(SCHEMA))
    mixed = Sampler()(logits, params, gens(), [None, state, None])
    assert torch.equal(logits, before)                 # the caller's logits are never written
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert int(mixed[1]) in _allowed(grammars, state)


def test_sampler_rejects_a_wrong_number_of_grammars():
    with pytest.raises(ValueError, match="one grammar"):
        Sampler()(torch.zeros(2, 8), [SamplingParams()] * 2, [None, None], [None])
