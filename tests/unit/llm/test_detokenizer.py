"""Incremental detokenization: same text as a full decode; stop strings cut exactly."""

from __future__ import annotations

import pytest

from services.llm.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


TEXTS = ["a red circle", "Écrire en français 🙂 ünïcödé", "What shape is it? A star!", "  spaced   out  "]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tokenizer, ())
    streamed = "".join(d.push(i)[0] for i in ids) + d.flush()
    assert streamed == tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text,stop,expected",
    [
        ("a red circle and more", ("circle",), "a red "),
        ("What shape is it? A star!", ("?",), "What shape is it"),
        ("no stop here", ("zzz",), "no stop here"),
        ("abc abc", ("c a", "bc"), "a"),
    ],
)
def test_stop_strings(tokenizer, text, stop, expected):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tokenizer, stop)
    out, stopped = "", False
    for i in ids:
        delta, stopped = d.push(i)
        out += delta
        if stopped:
            break
    out += d.flush()
    assert out == expected
    assert stopped == (expected != text)


@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_the_rust_decode_is_transformers_decode(tokenizer, model):
    """What the detokenizer calls (the fast tokenizer's Rust side) gives what transformers' `decode`
    gives with no clean-up, special tokens and arbitrary id runs included."""
    import random

    from transformers import AutoTokenizer

    from tests.helpers import ROOT

    tok = tokenizer if model == "tiny" else AutoTokenizer.from_pretrained(ROOT / "models" / "demo")
    assert tok.backend_tokenizer is not None
    rng = random.Random(7)
    special = list(tok.all_special_ids)
    for n in (1, 2, 5, 17, 64):
        for _ in range(40):
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(n)]
            want = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert Detokenizer(tok, ())._decode(ids) == want, ids
