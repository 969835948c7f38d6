"""Speculative decoding: a decoding sequence's next few tokens proposed, and verified within its step.

Why: a decode step at a small batch is bound by reading the weights (on a
GPU) or by the step's fixed costs (on a CPU: Python, a call per operation),
not by its rows, so k + 1 rows cost little more than one. Where the proposals
are right, a sequence gains up to k tokens per step.

Proposals are a function of the sequence's tokens alone: prompt lookup's
(prompt_lookup.py) or a draft model's greedy ones (draft.py).

Verification (the engine, model_runner.py, sampler.py): the sequence's last
token and its k proposals are k + 1 decoding rows of the step, row j
attending to the cache up to itself (the step stores every row's keys and
values before any row attends), so the decode kernels and graphs serve them
as they serve k + 1 sequences; the sampler draws the target's token at
every row exactly as without speculation, as if the proposals before that row
had been accepted (penalties over them, the grammar's mask after them, the
noise of (seed, token index)). Proposals are accepted while each equals the
draw at its row (`accepted_length`); the draw at the first that differs, or
after the last, is the step's own next token.

Greedy, that is the longest matching prefix plus the model's own next token.
Sampling, it is rejection sampling (Leviathan et al. 2023, Chen et al. 2023)
for a proposer whose distribution q puts all its mass on its proposal x: x is
accepted with probability min(1, p(x)/q(x)) = p(x), the chance that the draw
is x, and in its place comes the draw given that it is not x, whose
distribution is the residual norm(max(0, p − q)). Every token keeps the
target's distribution, and as the draw at each index uses that index's noise,
a request's tokens are those it gets without speculation: alone, in a batch,
after a preemption, after a failover.

The rows after the accepted ones wrote KV that is not the sequence's: its
cached length stops at its accepted tokens (the next steps overwrite those
slots) and the blocks wholly past its tokens are freed.

Proposals cost rows, and a draft model's steps. `Speculator` fits the time of
a step that only decodes, proposing included, against its rows (a
least-squares line, seconds = a + b·rows, over the recent such steps: a
prompt's rows cost far less each) and measures the share of proposals
accepted, ρ; with B sequences drawing in a step of R rows, proposals raise
the tokens per second when ρ > b·B / (a + b·R). A step where they would not
proposes nothing. One step in 16 does the opposite (proposes where it would
not, or not where it would), so that ρ and both kinds of step stay measured.
Each switch is logged with its figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.prompt_lookup import NgramProposer
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence

log = structlog.get_logger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft")
_PROBE_EVERY = 16  # steps: one in this many does what proposals' paying says not to, to keep measuring both
_DECAY = 0.95  # per step, of the cost line's sums and of the acceptance: about the last 20 steps weigh
_FIT_STEPS = 8  # steps measured before the cost line is trusted


class Proposer(Protocol):
    """Proposes tokens: prompt lookup (prompt_lookup.py) or a draft model (draft.py)."""

    def propose(self, sequences: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow sequences[i]'s, a function of its tokens alone."""

    def forget(self, sequence: Sequence) -> None:
        """The sequence has ended: what is kept for it goes."""


def accepted_length(proposed: tuple[int, ...], drawn: list[int]) -> int:
    """How many proposals are accepted: those equal, from the first, to the target's draw at their row."""
    for index, token in enumerate(proposed):
        if drawn[index] != token:
            return index
    return len(proposed)


@dataclass
class SpeculationCounts:
    """Since start: tokens proposed, of those accepted, and verifications (a sequence's proposals in a step)."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0


class CostLine:
    """A step's seconds against its rows, seconds = a + b·rows, fitted by least squares over the recent steps
    (each step's weight decays by _DECAY per step after it)."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # decayed: steps, rows, seconds, rows², rows·seconds

    def add(self, rows: int, seconds: float) -> None:
        observed = (1.0, rows, seconds, rows * rows, rows * seconds)
        self._sums = [_DECAY * total + value for total, value in zip(self._sums, observed, strict=True)]

    def fit(self) -> tuple[float, float] | None:
        """(a, b), each at least 0; None until _FIT_STEPS steps are in, and their rows have varied."""
        steps, rows, seconds, squares, products = self._sums
        if steps < (1 - _DECAY**_FIT_STEPS) / (1 - _DECAY) - 1e-9:  # the decayed count of _FIT_STEPS steps
            return None
        variance = squares / steps - (rows / steps) ** 2
        if variance < 1e-6:
            return None
        slope = max(0.0, (products / steps - rows / steps * seconds / steps) / variance)
        return max(0.0, seconds / steps - slope * rows / steps), slope


def proposals_pay(acceptance: float, line: tuple[float, float] | None, drawing: int, rows: int) -> bool:
    """Whether proposals raise the tokens per second of a step of `rows` rows where `drawing` sequences draw,
    when a share `acceptance` of them is accepted and a step costs line = (a, b): a + b·rows seconds.

    With D proposals, the step yields drawing + acceptance·D tokens in a + b·(rows + D) seconds, against
    drawing tokens in a + b·rows: more per second iff acceptance·(a + b·rows) > b·drawing. Unmeasured (None),
    they are taken to pay.
    """
    return line is None or acceptance * (line[0] + line[1] * rows) > line[1] * drawing


class Speculator:
    """Gives a step's decoding chunks their proposals, where they pay (see the module's docstring)."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_seq_len: int) -> None:
        self._proposer = proposer
        self._k = num_tokens
        self._max_seq_len = max_seq_len
        self.counts = SpeculationCounts()
        self.cost = CostLine()
        self.acceptance = 1.0  # of the recent steps' proposals, decayed: optimistic until measured
        self._on = True  # whether proposals paid at the last step
        self._steps = 0  # since that last changed
        self._step_proposed = self._step_accepted = 0

    def plan(self, chunks: list[Chunk], blocks: BlockManager, budget: int) -> list[Chunk]:
        """The chunks, decoding ones with proposals where these pay and fit the step's budget and the cache."""
        speculating = [
            i
            for i, c in enumerate(chunks)
            if c.samples
            and c.num_tokens == 1
            and c.sequence.generated  # the last token is a generated one, not a cached prompt's
            and c.sequence.request.sampling.speculative
        ]
        if not speculating or not self._worth_it(sum(c.samples for c in chunks), sum(c.num_tokens for c in chunks)):
            return chunks
        room = budget - sum(c.num_tokens for c in chunks)
        asked: list[tuple[int, int]] = []  # (chunk index, tokens it may propose)
        for index in speculating:
            sequence = chunks[index].sequence
            k = min(
                self._k,
                room,
                sequence.max_new_tokens - len(sequence.generated) - 1,  # the step adds up to k + 1 tokens
                self._max_seq_len - sequence.num_tokens - 1,
            )
            if k > 0:
                asked.append((index, k))
                room -= k
        proposals = self._proposer.propose([chunks[i].sequence for i, _ in asked], [k for _, k in asked])
        planned = list(chunks)
        for (index, _), proposal in zip(asked, proposals, strict=True):
            sequence = chunks[index].sequence
            if sequence.matcher is not None:  # a proposal outside the grammar could never be accepted
                proposal = proposal[: sequence.matcher.validate_tokens(proposal)]
            while proposal and not blocks.can_grow(sequence, sequence.num_tokens + len(proposal)):
                proposal.pop()
            if proposal:
                blocks.grow(sequence, sequence.num_tokens + len(proposal))
                planned[index] = replace(chunks[index], proposed=tuple(proposal))
        return planned

    def forget(self, sequence: Sequence) -> None:
        """The sequence has ended."""
        self._proposer.forget(sequence)

    def settled(self, proposed: int, accepted: int) -> None:
        """One sequence's proposals were verified: `accepted` of `proposed` taken."""
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        self.counts.verifications += 1
        self._step_proposed += proposed
        self._step_accepted += accepted

    def measured(self, rows: int | None, seconds: float) -> None:
        """A step took `seconds`: the acceptance learns from it, and the cost line from a step of `rows`
        decoding rows (None: a step with prompt chunks, whose rows cost otherwise)."""
        if rows is not None:
            self.cost.add(rows, seconds)
        if self._step_proposed:
            share = self._step_accepted / self._step_proposed
            self.acceptance = _DECAY * self.acceptance + (1 - _DECAY) * share
        self._step_proposed = self._step_accepted = 0

    def _worth_it(self, drawing: int, rows: int) -> bool:
        """Whether this step proposes: where proposals pay, except that one step in _PROBE_EVERY does the other,
        so that both kinds of step stay measured (a fixed k would otherwise leave the cost line one point). A
        change of mind is logged."""
        line = self.cost.fit()
        pays = proposals_pay(self.acceptance, line, drawing, rows)
        if pays != self._on:
            self._on, self._steps = pays, 0
            log.info(
                "speculation_switched",
                on=pays,
                acceptance=round(self.acceptance, 3),
                step_s=round(line[0], 6) if line else None,
                row_s=round(line[1], 7) if line else None,
                drawing=drawing,
                rows=rows,
            )
        self._steps += 1
        return pays != (self._steps % _PROBE_EVERY == 0)


def speculator_for(config: EngineConfig, target: Any, target_tokens: int) -> Speculator | None:
    """The speculator an EngineConfig asks for (None: no speculation); `target`: the LoadedModel it serves, whose
    KV cache holds `target_tokens` tokens (a draft model's holds as many)."""
    if not config.speculative:
        return None
    if config.speculative == "ngram":
        proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
    elif config.speculative == "draft":
        from workers.engine.draft import DraftProposer  # it imports torch, which a simulated worker does without
        from workers.engine.model_loader import load_model

        dtype = str(target.model.dtype).removeprefix("torch.")
        draft = load_model(config.speculative_model, str(target.device), dtype)
        proposer = DraftProposer(draft, target, config, target_tokens)
    else:
        raise ValueError(f"speculative {config.speculative!r} is none of {', '.join(SPECULATIVE_METHODS)}")
    return Speculator(proposer, config.num_speculative_tokens, config.max_seq_len)
