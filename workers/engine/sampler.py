"""Pick each sequence's next token from its logits, with its own parameters.

The logits processors are transformers' own, so that a request means here
what it means to `generate`. The random draw is reproducible from the
request's seed and the token's index alone: whatever else is in the batch,
whichever worker runs it, and after a recomputation, token i of a seeded
request is drawn with the same noise.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from schemas.messages import SamplingParams

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: spreads nearby seeds apart
_U64 = 2**64


def logits_processors(params: SamplingParams) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.typical_p is not None and params.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(params.typical_p))
    return processors


def _finite_limit(scores: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Scores softmax can take, even after extreme parameters overflowed them.

    A repetition penalty of 1e-300 or a temperature of 1e-6 may turn scores
    into +inf (or inf - inf = nan). In the limit such a distribution puts all
    its mass evenly on the +inf tokens, which is what this returns; with no
    finite or +inf score left, the model's own logits decide.
    """
    if torch.isfinite(scores).all():
        return scores
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"))
    infinite = torch.isposinf(scores)
    if infinite.any():
        return torch.where(infinite, 0.0, float("-inf"))
    if torch.isneginf(scores).all():
        return logits.float().unsqueeze(0)
    return scores


def noise_seed(seed: int, token_index: int) -> int:
    return (seed + (token_index + 1) * _GOLDEN_GAMMA) % _U64


def next_token(
    logits: torch.Tensor,
    token_ids: list[int],
    params: SamplingParams,
    processors: LogitsProcessorList,
    token_index: int,
) -> int:
    """The next token after `token_ids` (prompt and generated so far).

    `logits` is the model's output for the last position, shape (vocab,).
    """
    scores = logits.float().unsqueeze(0)
    if processors:
        scores = _finite_limit(processors(torch.tensor([token_ids], device=logits.device), scores), logits)
    if not params.do_sample:
        return int(scores.argmax(dim=-1))
    probabilities = torch.softmax(scores, dim=-1)
    generator = torch.Generator(device=logits.device).manual_seed(noise_seed(params.seed, token_index))
    return int(torch.multinomial(probabilities, 1, generator=generator))
