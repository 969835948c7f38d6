"""The model's output projection (hidden state -> vocabulary logits), and an exact fast greedy path.

With a small model and a large vocabulary the output projection is most of a
decode step's arithmetic. On CPUs with native bfloat16 matrix instructions a
bfloat16 projection runs about three times faster than float32, but it is
not exact. Greedy rows therefore take this path:
1. bfloat16 logits for the whole vocabulary;
2. a bound on their error: rounding hidden and weights to bfloat16 moves a
   logit by at most (2u + u^2) |h| |w_j| (Cauchy-Schwarz, u = 2^-8), and
   rounding the logit itself by u |logit|;
3. the exact float32 logits of every token whose bfloat16 logit is within
   twice the bound of the best one: the true argmax is among them (rows so
   flat that too many tokens are, get the float32 projection instead).
The argmax is the float32 one. Rows that sample, or that carry a repetition
penalty, get exact float32 logits for the whole vocabulary.

A row with a NaN logit (a NaN hidden state) has no argmax, and no candidate
on the bfloat16 path: its token is None, never an id that the next step's
embedding lookup would fail on, failing the whole batch. The engine ends that
sequence with an error, and the rest of the batch goes on.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

_UNIT = 2.0**-8  # bfloat16's unit roundoff
_CALIBRATION_ROWS = 64
_MAX_CANDIDATES_PER_ROW = 64  # on average; more, and the whole float32 projection is cheaper


class OutputHead:
    def __init__(self, projection: torch.nn.Linear, fast: bool | None = None) -> None:
        """`fast`: use the bfloat16 path for greedy rows; None: where it is measured to pay off."""
        self._weight = projection.weight.detach()
        self._bias = None if projection.bias is None else projection.bias.detach()
        self._fast: torch.Tensor | None = None
        possible = self._weight.device.type == "cpu" and self._weight.dtype == torch.float32 and self._bias is None
        if possible and fast is not False:
            candidate = self._weight.to(torch.bfloat16)
            if fast or _faster(candidate, self._weight):
                self._fast = candidate
                self._max_row_norm = float(self._weight.norm(dim=1).max())

    @property
    def fast(self) -> bool:
        return self._fast is not None

    @property
    def vocab_size(self) -> int:
        """Logits per row (the projection's outputs; some models pad it past the tokenizer's vocabulary)."""
        return self._weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._weight, self._bias)

    def argmax(self, hidden: torch.Tensor) -> list[int | None]:
        """The exact argmax of each row's logits; None for a row with a NaN logit."""
        if self._fast is None:
            return _argmax(self.logits(hidden))
        rows_count, vocab = hidden.shape[0], self._weight.shape[0]
        # float32 from here: CPUs reduce and compare bfloat16 much more slowly
        approximate = F.linear(hidden.to(torch.bfloat16), self._fast).float()
        best = approximate.amax(dim=-1)  # NaN in a row with a NaN logit: none is a candidate there
        # A logit's error is at most a + u'|logit|, and a candidate's |logit| at most |best| + 2E, so
        # E = (a + u'|best|) / (1 - 2u') bounds the error of every logit that could still be the argmax.
        shift = (2 * _UNIT + _UNIT**2) * hidden.norm(dim=-1) * self._max_row_norm
        rounding = _UNIT * (1 + _UNIT)
        threshold = best - 2 * (shift + rounding * best.abs()) / (1 - 2 * rounding)
        rows, ids = (approximate >= threshold.unsqueeze(1)).nonzero(as_tuple=True)
        if rows.numel() > _MAX_CANDIDATES_PER_ROW * rows_count:  # near-flat rows: exact logits cost less
            return _argmax(self.logits(hidden))
        exact = (self._weight[ids] * hidden[rows]).sum(dim=-1)
        row_best = exact.new_full((rows_count,), float("-inf")).scatter_reduce(0, rows, exact, "amax")
        # Ties go to the lowest token id, as argmax over the whole vocabulary would have it.
        winning = exact == row_best[rows]
        lowest = ids.new_full((rows_count,), vocab).scatter_reduce(0, rows[winning], ids[winning], "amin")
        return [None if token == vocab else token for token in lowest.tolist()]  # vocab: no candidate


def _argmax(logits: torch.Tensor) -> list[int | None]:
    """Each row's argmax; None for a row with a NaN logit (torch's argmax would answer the NaN's place)."""
    tokens, nan = logits.argmax(dim=-1).tolist(), logits.isnan().any(dim=-1).tolist()
    return [None if not_a_number else token for token, not_a_number in zip(tokens, nan, strict=True)]


def _faster(fast: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether the bfloat16 projection beats float32 by a margin on this machine."""
    hidden = torch.randn(_CALIBRATION_ROWS, exact.shape[1])

    def seconds(weight: torch.Tensor) -> float:
        x = hidden.to(weight.dtype)
        F.linear(x, weight)  # warm up
        start = time.perf_counter()
        for _ in range(3):
            F.linear(x, weight)
        return time.perf_counter() - start

    with torch.inference_mode():
        return seconds(fast) < 0.7 * seconds(exact)


class GatheredHead:
    """A tensor-parallel model's head, vocabulary-parallel: each rank computes the logits of its rows of the
    vocabulary, and rank 0 gets them all (parallel.gather_columns). Every rank calls `logits` with the same
    hidden states; rank 0 first calls `announce(hidden)`, which has the other ranks do so (model_runner.py).
    Only rank 0 samples: the others' `logits` return None."""

    fast = False  # the bfloat16 argmax would need the whole vocabulary's weights on rank 0

    def __init__(self, projection: torch.nn.Module, parallel, vocab: int, announce=None) -> None:
        self._weight = projection.weight.detach()
        self._parallel, self._vocab, self._announce = parallel, vocab, announce
        self._share = -(-vocab // parallel.size)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self._announce is not None:
            self._announce(hidden)
        return self._parallel.gather_columns(F.linear(hidden, self._weight), self._share, self._vocab)

    def argmax(self, hidden: torch.Tensor) -> list[int | None]:
        return _argmax(self.logits(hidden))
