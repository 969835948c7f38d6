"""Draw the next token of every sequence of a step at once, each with its own parameters.

Greedy rows take the argmax. Sampling rows go through temperature, top-k,
top-p and typical-p as transformers applies them, then draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which picks token i with
probability p_i. The noise of token i of a request comes from a generator
seeded with (seed, i) alone: whatever else is in the batch, after a
preemption, and on any worker, a seeded request draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import TypicalLogitsWarper

from schemas.messages import SamplingParams
from workers.engine.output_head import OutputHead

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: spreads nearby seeds apart
_U64 = 2**64


@dataclass(frozen=True)
class Draw:
    """What drawing one sequence's next token takes."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt and generated so far, for the repetition penalty
    index: int  # the request-wide index of the token drawn


def noise_seed(seed: int, token_index: int) -> int:
    return (seed + (token_index + 1) * _GOLDEN_GAMMA) % _U64


def sample(head: OutputHead, hidden: torch.Tensor, draws: list[Draw]) -> list[int]:
    """The next token of each sequence, from its last hidden state (`hidden` [rows, hidden size])."""
    tokens = [0] * len(draws)
    plain = [i for i, d in enumerate(draws) if not d.params.do_sample and d.params.repetition_penalty == 1.0]
    others = [i for i, d in enumerate(draws) if d.params.do_sample or d.params.repetition_penalty != 1.0]
    if plain:  # plain greedy rows need the argmax alone, which the head finds fastest
        for row, token in zip(plain, head.argmax(hidden[plain]), strict=True):
            tokens[row] = token
    if others:
        logits = head.logits(hidden[others])
        for row, token in zip(others, sample_logits(logits, [draws[i] for i in others]), strict=True):
            tokens[row] = token
    return tokens


def sample_logits(logits: torch.Tensor, draws: list[Draw]) -> list[int]:
    """The next token of each row of `logits` [rows, vocab]."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    scores = logits
    if any(d.params.repetition_penalty != 1.0 for d in draws):
        scores = logits.clone()
        _penalise_repetitions(scores, draws)
        scores = _finite_limit(scores, logits)  # a vanishing penalty can overflow a score
    tokens = scores.argmax(dim=-1)
    rows = [i for i, d in enumerate(draws) if d.params.do_sample]
    if rows:
        tokens[rows] = _draw(scores[rows], [draws[i] for i in rows], logits[rows])
    return tokens.tolist()


def _penalise_repetitions(scores: torch.Tensor, draws: list[Draw]) -> None:
    for row, draw in enumerate(draws):
        penalty = draw.params.repetition_penalty
        if penalty != 1.0:
            seen = torch.tensor(sorted(set(draw.token_ids)), device=scores.device)
            values = scores[row, seen]
            scores[row, seen] = torch.where(values < 0, values * penalty, values / penalty)


def _draw(scores: torch.Tensor, draws: list[Draw], logits: torch.Tensor) -> torch.Tensor:
    vocab = scores.shape[-1]
    temperatures = torch.tensor([d.params.temperature for d in draws], dtype=scores.dtype, device=scores.device)
    scores = _finite_limit(scores / temperatures.unsqueeze(1), logits)
    ordered, order = scores.sort(dim=-1, descending=True)
    # top-k: keep the k best of each row (0 = all)
    top_k = torch.tensor([d.params.top_k or vocab for d in draws], device=scores.device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=scores.device).unsqueeze(0)
    ordered = ordered.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    # top-p: keep the smallest head whose mass reaches top_p (at least one token)
    top_p = torch.tensor([d.params.top_p for d in draws], dtype=scores.dtype, device=scores.device)
    probabilities = ordered.softmax(dim=-1)
    mass_before = probabilities.cumsum(dim=-1) - probabilities
    ordered = ordered.masked_fill((mass_before >= top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    for row, draw in enumerate(draws):
        if draw.params.typical_p is not None and draw.params.typical_p < 1.0:
            ordered[row] = TypicalLogitsWarper(draw.params.typical_p)(None, ordered[row : row + 1])[0]
    probabilities = ordered.softmax(dim=-1)  # the best token of each row is finite: never all -inf
    noise = torch.stack([_exponential_noise(d, vocab, scores) for d in draws]).gather(1, order)
    choice = (probabilities / noise).argmax(dim=-1)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def _exponential_noise(draw: Draw, vocab: int, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator(device=like.device).manual_seed(noise_seed(draw.params.seed, draw.index))
    return torch.empty(vocab, dtype=like.dtype, device=like.device).exponential_(generator=generator)


def _finite_limit(scores: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Scores softmax can take, even after extreme parameters overflowed them.

    A repetition penalty of 1e-300 or a temperature of 1e-6 may turn scores
    into +inf (or inf - inf = nan). In the limit such a distribution puts all
    its mass evenly on the +inf tokens, which is what a row gets; a row left
    with no finite or +inf score falls back to `fallback`'s row.
    """
    if torch.isfinite(scores).all():
        return scores
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"))
    infinite = torch.isposinf(scores)
    limit = torch.where(infinite, 0.0, float("-inf")).to(scores.dtype)
    scores = torch.where(infinite.any(dim=-1, keepdim=True), limit, scores)
    dead = torch.isneginf(scores).all(dim=-1)
    if dead.any():
        scores[dead] = fallback[dead].to(scores.dtype)
    return scores
