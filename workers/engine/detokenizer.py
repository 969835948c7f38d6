"""Turn a growing list of token ids into text pieces, never half a character.

Byte-level tokenizers split multi-byte characters over tokens, and
SentencePiece tokenizers decide a token's leading space from its left
neighbour, so decoding each token alone is wrong. As TGI and vLLM do, decode a
short window that ends at the new tokens, compare it with the same window
without them, and emit the difference only once it no longer ends in an
incomplete character (U+FFFD).

For a fast (Rust) tokenizer whose decode cleans up nothing, the tokenizers
library's DecodeStream runs that same algorithm in Rust (as vLLM's fast
detokenizer does), about 5 times faster per token on the engine thread; the
window here keeps the offsets it moves, for the flush at the end and for the
rare window whose text does not extend its prefix, which DecodeStream
refuses and this decodes as before.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens kept on the left, for tokenizers whose spacing depends on them.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window decoded for comparison
        self._read_offset = len(self._ids)  # tokens before this are emitted as text
        self._backend = _stream_backend(tokenizer)
        self._stream = None if self._backend is None else DecodeStream(self._ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def decode_one(self, token_id: int) -> str:
        """One token's own text, special tokens included (to list a prompt token by token)."""
        return self._tokenizer.decode([token_id])

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # its window's text did not extend the prefix: decoded here from now on
                self._stream = None
            else:
                if text:
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return text or ""
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end of generation, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return after[len(before) :]


def _stream_backend(tokenizer):
    """A fast tokenizer's Rust tokenizer, where DecodeStream decodes as its `decode` does; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    return backend if backend is not None and not cleans_up else None
