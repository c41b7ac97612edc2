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
