"""Draw the next token of every sequence of a step at once, each with its own parameters.

Every row's logits first get its penalties and biases: the repetition
penalty (transformers'), then additions to single tokens (OpenAI's presence
and frequency penalties over the tokens generated so far, logit_bias, and
-inf for EOS and stop tokens before min_tokens), and rows with a grammar
lose every token it does not allow (grammar.py). Greedy rows take the argmax.
Sampling rows go through temperature, top-k, top-p, min-p and typical-p as
transformers applies them (rows that cut nothing skip the vocabulary sort
these need, most of a sampled step's cost on a CPU), then draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which picks token i with
probability p_i. The noise of token i of a request comes from a seed made of
(seed, i) alone: whatever else is in the batch, after a preemption, and on
any worker, a seeded request draws the same tokens (on the same kind of
device: a CPU draws its noise from a torch generator per row, a GPU from one
Triton launch for the batch, triton_sampling.py). The race is robust to the
last-bit differences between a batched and a lone forward pass: a token
changes only if two candidates tie within them.

Rows whose request asks for log-probabilities get them from the same logits
(step_output.py says which), in one more read.

The whole batch is one set of tensor operations on the device that computed
its logits: the parameters go up in one copy before the step's forward pass
(`DrawBatch.of`), and the tokens come back in one read; nothing in between
waits for the device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schemas.messages import SamplingParams
from workers.engine.output_head import OutputHead
from workers.engine.step_output import Scored
from workers.engine.transfer import to_device

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: spreads nearby seeds apart
_U64 = 2**64


@dataclass(frozen=True)
class Draw:
    """What drawing one sequence's next token takes."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt and generated so far, for the repetition penalty
    index: int  # the request-wide index of the token drawn
    generated: Sequence[int] = ()  # generated so far, for the presence and frequency penalties
    banned: Sequence[int] = ()  # tokens it may not draw (EOS and stop tokens before min_tokens)
    allowed: torch.Tensor | None = None  # with a grammar: the tokens it allows, a bitmask (grammar.allowed_tokens)


def noise_seed(seed: int, token_index: int) -> int:
    return (seed + (token_index + 1) * _GOLDEN_GAMMA) % _U64


# The rows of DrawBatch.values
_TEMPERATURE, _TOP_K, _TOP_P, _TYPICAL_P, _PENALTY, _MIN_P = range(6)


@dataclass(frozen=True)
class DrawBatch:
    """A step's draws as tensors: per-row parameters, and the tokens a repetition penalty applies to."""

    draws: list[Draw]
    values: torch.Tensor  # [6, rows] float64: temperature, top_k (vocab: all), top_p, typical_p, penalty, min_p
    seen: torch.Tensor | None  # flat indices row * vocab + token of the tokens a penalty applies to
    # Additions to single logits: flat indices (row * vocab + token) and what each adds (float64)
    added_at: torch.Tensor | None
    added: torch.Tensor | None
    grammar_rows: torch.Tensor | None  # the rows with a grammar
    allowed: torch.Tensor | None  # their bitmasks [grammar rows, ceil(vocab / 32)] int32
    sampling: torch.Tensor | None  # the rows that sample; None: none does
    noise_seeds: torch.Tensor | None  # per sampling row: noise_seed(seed, index) as int64 (two's complement)
    plain: list[int]  # rows that take the plain argmax (no sampling, no penalty, no log-probabilities)
    scored: list[int]  # rows whose request asks for log-probabilities
    unfiltered: int  # the first this many sampling rows draw from the whole distribution (no top-k, top-p...)
    typical: bool  # whether a sampling row has typical_p < 1
    min_p: bool  # whether a sampling row has min_p > 0

    @classmethod
    def of(cls, draws: list[Draw], vocab: int, device: torch.device) -> DrawBatch:
        params = [d.params for d in draws]
        values = [
            (
                p.temperature,
                p.top_k or vocab,
                p.top_p,
                p.typical_p or 1.0,
                p.repetition_penalty,
                p.min_p,
            )
            for p in params
        ]
        # Rows that only sample (no top-k, top-p, min-p or typical-p) first: their draw needs no sort.
        sampling = sorted(
            (row for row, p in enumerate(params) if p.do_sample), key=lambda r: _filters(params[r], vocab)
        )
        seeds = [_signed(noise_seed(draws[row].params.seed, draws[row].index)) for row in sampling]
        seen = [
            row * vocab + token
            for row, d in enumerate(draws)
            if d.params.repetition_penalty != 1.0
            for token in set(d.token_ids)
        ]
        added = _additions(draws, vocab)
        adding = {index // vocab for index in added}  # rows with an addition
        grammar_rows = [row for row, d in enumerate(draws) if d.allowed is not None]
        indices = [*sampling, *seeds, *seen, *grammar_rows, *added]
        indices = to_device(torch.tensor(indices, dtype=torch.long), device)  # one copy
        after_seen = 2 * len(sampling) + len(seen)
        after_grammar = after_seen + len(grammar_rows)
        allowed = torch.stack([draws[row].allowed for row in grammar_rows]) if grammar_rows else None
        return cls(
            draws=draws,
            values=to_device(torch.tensor(values, dtype=torch.float64).reshape(-1, 6).T.contiguous(), device),
            seen=indices[2 * len(sampling) : after_seen] if seen else None,
            added_at=indices[after_grammar:] if added else None,
            added=to_device(torch.tensor(list(added.values()), dtype=torch.float64), device) if added else None,
            grammar_rows=indices[after_seen:after_grammar] if grammar_rows else None,
            allowed=to_device(allowed, device) if allowed is not None else None,
            sampling=indices[: len(sampling)] if sampling else None,
            noise_seeds=indices[len(sampling) : 2 * len(sampling)] if sampling else None,
            plain=[
                row
                for row, (d, p) in enumerate(zip(draws, params, strict=True))
                if not p.do_sample
                and p.repetition_penalty == 1.0
                and p.logprobs is None
                and d.allowed is None
                and row not in adding
            ],
            scored=[row for row, p in enumerate(params) if p.logprobs is not None],
            unfiltered=sum(not _filters(params[row], vocab) for row in sampling),
            typical=any(params[row].typical_p is not None and params[row].typical_p < 1.0 for row in sampling),
            min_p=any(params[row].min_p > 0 for row in sampling),
        )


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampling row cuts its distribution (top-k, top-p, min-p, typical-p): its draw sorts the row."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0 or (p.typical_p is not None and p.typical_p < 1.0)


def _additions(draws: list[Draw], vocab: int) -> dict[int, float]:
    """Flat index (row * vocab + token) -> what is added to that logit: penalties, biases, bans.

    Biased and banned ids outside the vocabulary are left out: no logit is theirs, and a token that cannot be
    drawn needs no ban. The gateway refuses them, but a request may come from a gateway of another version, or be
    served by a model of another vocabulary; and an index past the scores is an IndexError on the CPU and, on
    CUDA, a device-side assert that poisons the worker for every later request."""
    vocabulary = range(vocab)
    added: dict[int, float] = {}
    for row, draw in enumerate(draws):
        p, base = draw.params, row * vocab
        if p.presence_penalty or p.frequency_penalty:
            for token, count in Counter(draw.generated).items():
                added[base + token] = -(p.presence_penalty + p.frequency_penalty * count)
        for token, bias in p.logit_bias.items():
            if token in vocabulary:
                added[base + token] = added.get(base + token, 0.0) + bias
        for token in draw.banned:
            if token in vocabulary:
                added[base + token] = float("-inf")
    return added


def sample(head: OutputHead, hidden: torch.Tensor, batch: DrawBatch) -> tuple[list[int | None], list[Scored | None]]:
    """The next token of each row, from its last hidden state (`hidden` [rows, hidden size]), and its scores
    where its request asks for them; a plain greedy row's token is None where its logits are NaN
    (OutputHead.argmax)."""
    if not head.fast or not batch.plain:
        logits = head.logits(hidden)
        tokens = choose(logits, batch)
        return tokens.tolist(), _scores_of(logits, tokens, batch)
    # The CPU's fast head finds plain greedy rows' argmax without their whole float32 logits.
    tokens: list[int | None] = [0] * hidden.shape[0]
    scores: list[Scored | None] = [None] * hidden.shape[0]
    for row, token in zip(batch.plain, head.argmax(hidden[batch.plain]), strict=True):
        tokens[row] = token
    plain = set(batch.plain)
    others = [row for row in range(hidden.shape[0]) if row not in plain]
    if others:
        rest = DrawBatch.of([batch.draws[row] for row in others], head.vocab_size, hidden.device)
        logits = head.logits(hidden[others])
        chosen = choose(logits, rest)
        for row, token, scored in zip(others, chosen.tolist(), _scores_of(logits, chosen, rest), strict=True):
            tokens[row], scores[row] = token, scored
    return tokens, scores


def _scores_of(logits: torch.Tensor, tokens: torch.Tensor, batch: DrawBatch) -> list[Scored | None]:
    scores: list[Scored | None] = [None] * logits.shape[0]
    if batch.scored:
        tops = [batch.draws[row].params.logprobs or 0 for row in batch.scored]
        rows = batch.scored
        for row, scored in zip(rows, score(logits[rows], tokens[rows], tops), strict=True):
            scores[row] = scored
    return scores


def score(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[Scored]:
    """Each row's token's log-probability under `logits` [rows, vocab], with its `tops[row]` likeliest tokens'."""
    logprobs = _at_least_float32(logits).log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k = max(tops, default=0)
    if not k:
        return [Scored(value) for value in chosen]
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        Scored(value, list(zip(ids[row][:top], values[row][:top], strict=True)))
        for row, (value, top) in enumerate(zip(chosen, tops, strict=True))
    ]


def choose(logits: torch.Tensor, batch: DrawBatch) -> torch.Tensor:
    """The next token of each row of `logits` [rows, vocab], on their device."""
    logits = _at_least_float32(logits)
    scores = logits
    if batch.seen is not None:
        penalty = batch.values[_PENALTY].to(logits.dtype).unsqueeze(1)
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        seen.view(-1)[batch.seen] = True
        scores = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        scores = _finite_limit(scores, logits)  # a vanishing penalty can overflow a score
    if batch.added_at is not None:
        scores = scores.clone() if scores is logits else scores
        scores.view(-1).index_add_(0, batch.added_at, batch.added.to(scores.dtype))
    if batch.grammar_rows is not None:
        scores = scores.clone() if scores is logits else scores
        rows = batch.grammar_rows
        scores[rows] = scores[rows].masked_fill(~_unpacked(batch.allowed, scores.shape[-1]), float("-inf"))
    tokens = scores.argmax(dim=-1)
    if batch.sampling is not None:
        free, seeds = batch.unfiltered, batch.noise_seeds
        whole, cut = batch.sampling[:free], batch.sampling[free:]
        if free:
            tokens[whole] = _race(_tempered(scores[whole], batch.values[:, whole], logits[whole]), seeds[:free])
        if free < len(batch.sampling):
            tokens[cut] = _draw(scores[cut], batch.values[:, cut], logits[cut], batch, seeds[free:])
    return tokens


def _tempered(scores: torch.Tensor, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return _finite_limit(scores / values[_TEMPERATURE].to(scores.dtype).unsqueeze(1), logits)


def _race(scores: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The exponential race over whole rows: token i wins with probability p_i."""
    return (scores.softmax(dim=-1) / _exponential_noise(seeds, scores.shape[-1], scores)).argmax(dim=-1)


def _draw(scores: torch.Tensor, values: torch.Tensor, logits: torch.Tensor, batch: DrawBatch, seeds: torch.Tensor):
    """Rows that cut their distributions first; values: the rows' DrawBatch.values (float64); seeds: their
    noise seeds."""
    vocab = scores.shape[-1]
    scores = _tempered(scores, values, logits)
    values = values.to(scores.dtype)
    # Stable: tied tokens keep one order whatever the batch, so top-k keeps the same ones.
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scores.device).unsqueeze(0)
    ordered = ordered.masked_fill(ranks >= values[_TOP_K].unsqueeze(1), float("-inf"))  # top-k
    # top-p: keep the smallest head whose mass reaches top_p (at least one token)
    probabilities = ordered.softmax(dim=-1)
    mass_before = probabilities.cumsum(dim=-1) - probabilities
    ordered = ordered.masked_fill((mass_before >= values[_TOP_P].unsqueeze(1)) & (ranks > 0), float("-inf"))
    if batch.min_p:  # relative to the likeliest token, which top-k and top-p always keep first
        probabilities = ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(probabilities < values[_MIN_P].unsqueeze(1) * probabilities[:, :1], float("-inf"))
    if batch.typical:
        mass = values[_TYPICAL_P].unsqueeze(1)
        ordered = torch.where(mass < 1.0, _typical(ordered, mass), ordered)
    probabilities = ordered.softmax(dim=-1)  # the best token of each row is finite: never all -inf
    noise = _exponential_noise(seeds, vocab, scores).gather(1, order)  # by token id, whatever the order
    choice = (probabilities / noise).argmax(dim=-1)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def _exponential_noise(seeds: torch.Tensor, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] of like's dtype, row r from seeds[r] alone."""
    if seeds.device.type == "cuda":
        from workers.engine.triton_sampling import exponential_noise

        return exponential_noise(seeds, vocab).to(like.dtype)
    # On CPUs a torch generator per row costs least (counter-based noise in tensor ops costs several times more).
    return torch.stack(
        [
            torch.empty(vocab, dtype=like.dtype).exponential_(generator=torch.Generator().manual_seed(seed % _U64))
            for seed in seeds.tolist()
        ]
    )


def _unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """An int32 bitmask [rows, words] (bit t % 32 of word t // 32 is token t) as booleans [rows, vocab]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab]


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _signed(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return value - _U64 if value >= 2**63 else value


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """transformers' TypicalLogitsWarper (min_tokens_to_keep 1), for rows of masses `mass` [rows, 1] at once."""
    normalized = scores.log_softmax(dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(dim=-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    sorted_shifted, indices = shifted.sort(dim=-1)
    cumulative = scores.gather(-1, indices).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(-1, last)
    remove[:, 0] = False
    return scores.masked_fill(remove.scatter(-1, indices, remove), float("-inf"))


def _finite_limit(scores: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Scores softmax can take, even after extreme parameters overflowed them.

    A repetition penalty of 1e-300 or a temperature of 1e-6 may turn scores
    into +inf (or inf - inf = nan). In the limit such a distribution puts all
    its mass evenly on the +inf tokens, which is what a row gets; a row left
    with no finite or +inf score falls back to `fallback`'s row.
    """
    if scores.device.type == "cpu" and torch.isfinite(scores).all():
        return scores  # the common case, checked where a check costs no wait for a device
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"))
    infinite = torch.isposinf(scores)
    limit = torch.where(infinite, 0.0, float("-inf")).to(scores.dtype)
    scores = torch.where(infinite.any(dim=-1, keepdim=True), limit, scores)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.where(dead, fallback.to(scores.dtype), scores)
