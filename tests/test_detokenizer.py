"""Incremental detokenization with the bundled byte-level BPE tokenizer."""

import pytest
from transformers import AutoTokenizer

from workers.bundled import BUNDLED_MODEL
from workers.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


@pytest.mark.parametrize(
    "text",
    [
        " naïve café — déjà vu",
        " 你好，世界",
        " emoji 🚀🔥 and ünïcödé",
        "def f(x):\n    return x ** 2\n",
    ],
)
def test_pieces_concatenate_to_the_text_and_never_split_a_character(tokenizer, text):
    prompt = tokenizer("Some prompt")["input_ids"]
    generated = tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token) for token in generated]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Multi-byte characters span several byte-level tokens: some steps must wait.
    if any(ord(c) > 0x7F for c in text):
        assert "" in pieces[:-1]


def test_special_tokens_add_no_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    assert detokenizer.add(tokenizer.encode(" yes", add_special_tokens=False)[0]) == " yes"
    assert detokenizer.add(tokenizer.eos_token_id) == ""
    assert detokenizer.flush() == ""


def test_flush_emits_an_incomplete_character_at_the_end(tokenizer):
    rocket = tokenizer("🚀", add_special_tokens=False)["input_ids"]
    assert len(rocket) > 1  # four UTF-8 bytes, not one token in this vocabulary
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(rocket[0]) == ""
    assert detokenizer.flush() == "\ufffd"  # what a generation cut there really produced
