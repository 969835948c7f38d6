"""Prompt lookup: a sequence's next tokens proposed from its own past (vLLM's `ngram`, TGI's n-gram speculation).

The longest n-gram ending the context (n from ngram_max down to ngram_min)
that occurred earlier proposes the k tokens that followed its latest
occurrence, continued periodically where they run into the present, so that
a loop is proposed whole. Text that repeats itself (code being edited,
quotations, a small model's loops) is proposed right; other text mostly gets
no proposal at all, which costs nothing. Each sequence keeps an index of its
n-grams, grown with its tokens: a lookup is a few dictionary reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.sequence import Sequence


@dataclass
class _Ngrams:
    """A sequence's n-grams: each one's latest end (the index of the token that followed it)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens [0, indexed) have had the n-grams ending before them recorded


class NgramProposer:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self._sizes = range(n_max, n_min - 1, -1)  # longest first

    def propose(self, sequences: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens proposed after sequences[i]'s."""
        return [self._propose(sequence, k) for sequence, k in zip(sequences, ks, strict=True)]

    def forget(self, sequence: Sequence) -> None:
        """Its n-grams go with it."""

    def _propose(self, sequence: Sequence, k: int) -> list[int]:
        ngrams = sequence.ngrams
        if ngrams is None:
            ngrams = sequence.ngrams = _Ngrams()
        tokens = sequence.token_ids
        length = len(tokens)
        for end in range(ngrams.indexed, length):  # tokens only grow: record what is new since the last call
            for n in self._sizes:
                if end >= n:
                    ngrams.ends[tuple(tokens[end - n : end])] = end
        ngrams.indexed = length
        for n in self._sizes:
            start = ngrams.ends.get(tuple(tokens[length - n :])) if length > n else None
            if start is not None:
                proposal: list[int] = []
                for i in range(k):  # past the present, the proposal continues itself: a loop's period repeats
                    at = start + i
                    proposal.append(tokens[at] if at < length else proposal[at - length])
                return proposal
        return []
