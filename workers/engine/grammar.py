"""Structured output: llguidance matchers that say, token by token, what a grammar still allows.

The gateway turns a JSON schema or a regex into an llguidance grammar and
checks it (gateway/structured/grammars.py); here a worker compiles it for its
tokenizer, on a thread of its own so that neither the event loop nor a step
waits, and keeps the compiled grammar by content: requests with the same
schema each get a copy. A sequence's matcher advances with every token it
generates (and with the tokens a failover hands over), and before each step
yields the bitmask of the tokens allowed next, which the sampler applies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher

_CACHED_GRAMMARS = 256


class GrammarError(Exception):
    """A grammar this worker cannot compile (the gateway checks grammars without a tokenizer)."""


class Grammars:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        """`tokenizer`: the model's Hugging Face tokenizer; `vocab_size`: logits per row."""
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.2 s)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def compile(self, grammar: str, done: Callable[[LLMatcher | GrammarError], None]) -> None:
        """Compile off the caller's thread; `done` gets a fresh matcher, or why there is none."""

        def run() -> None:
            try:
                done(self.matcher(grammar))
            except GrammarError as error:
                done(error)

        self._pool.submit(run)

    def matcher(self, grammar: str) -> LLMatcher:
        """A matcher at the grammar's start (compiled once per grammar; each caller gets a copy)."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise GrammarError(compiled.get_error())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size)
                except Exception as error:  # a tokenizer llguidance cannot read (not a fast one)
                    raise GrammarError(f"this model's tokenizer cannot constrain output: {error}") from None
            return self._tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(matcher: LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the matcher allows next, as a bitmask: int32 [ceil(vocab / 32)], bit t % 32 of word t // 32."""
    bitmask = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    # What llguidance.torch's fill_next_token_bitmask does, without importing that module (it sets up
    # torch.compile for a kernel the sampler does not use).
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
    return bitmask
