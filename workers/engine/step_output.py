"""What one engine step yields: each drawn token, the log-probabilities its request asked for, embeddings.

A log-probability is the log-softmax of the model's raw logits, before
temperature, penalties and filtering (vLLM's default, `raw_logprobs`): what
the model thinks of the token, whatever the request then did with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scored:
    """A token's log-probability, and the likeliest tokens' as (token id, log-probability), likeliest first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutput:
    tokens: list[int | None]  # the next token of each drawing chunk, in order; None: its logits were NaN
    logprobs: list[Scored | None]  # per drawing chunk: its token's scores, when its request asks for them
    # Request id -> scores of the prompt tokens its chunk predicts (each row scores the token after it).
    prompt_logprobs: dict[str, list[Scored]] = field(default_factory=dict)
    # Request id -> the embedding of each embed request whose prompt the step completed (pooling.py).
    embeddings: dict[str, list[float]] = field(default_factory=dict)
