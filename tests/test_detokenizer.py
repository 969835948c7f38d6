"""Incremental detokenization with the bundled byte-level BPE tokenizer."""

import random

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


class _WindowOnly:
    """The bundled tokenizer's decode alone: the detokenizer decodes its windows itself (no DecodeStream)."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_gives_the_window_s_pieces_token_for_token(tokenizer, skip_special_tokens):
    """Random ids (special tokens and lone bytes of multi-byte characters among them) and real text: DecodeStream's
    pieces are the window's, flush included."""
    rng = random.Random(7)
    texts = [" naïve café 你好 🚀 def f(x):\n    return x", "".join(chr(rng.randrange(32, 0x3000)) for _ in range(300))]
    sequences = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    sequences.append([rng.randrange(0, tokenizer.vocab_size) for _ in range(3000)])
    prompt = tokenizer("Some prompt")["input_ids"]
    for ids in sequences:
        stream = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        window = IncrementalDetokenizer(_WindowOnly(tokenizer), prompt, skip_special_tokens)
        assert [stream.add(i) for i in ids] == [window.add(i) for i in ids]
        assert stream.flush() == window.flush()


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_as_its_decode_does():
    """DecodeStream would leave " ," as it is; transformers' decode cleans it up (for a BPE tokenizer only when
    forced: it is a WordPiece habit), and so must the pieces."""
    forced = {"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
    cleaning = AutoTokenizer.from_pretrained(BUNDLED_MODEL, clean_up_tokenization_spaces=True, **forced)
    ids = cleaning("x , y .", add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(cleaning, [])
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == cleaning.decode(ids) == "x, y."
