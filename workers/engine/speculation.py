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

Proposals cost rows, and a draft model's own steps. `Speculator` fits the
target's time for a step that only decodes against its rows (a least-squares
line, T(R) = a + b·R, over the recent such steps: a prompt's rows cost far
less each) and the proposer's time against the sequences asked (another
line), and measures the tokens proposed per sequence asked and the share of
them accepted, ρ. With B sequences drawing, D proposals that took P seconds
to make yield ρ·D more tokens for b·D + P more seconds: they raise the tokens
per second when ρ·D·T(B) > B·(b·D + P). (A step's prompt rows are left out:
proposals riding along a prompt's rows would look cheap, and those rows'
cost is not on the line.) A step where proposals would not pay proposes
nothing (as at large batches, or with a draft that costs about what the
target does). So that both kinds of step stay measured, while proposals pay
one step in 16 proposes nothing, and while they do not one sequence proposes
after 16 steps, then 32, 64, up to 256 (one: a draft model catching up the
tokens it missed makes such a step dear). Each switch is logged with its
figures.
"""

from __future__ import annotations

import time
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
_PROBE_EVERY = 16  # steps: while proposals pay, one in this many proposes nothing; while not, the first probe's wait
_PROBE_MOST = 256  # steps: while proposals do not pay, the wait between probes doubles up to this
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

    def at(self, rows: int) -> float:
        """The seconds a step of `rows` rows takes: on the fitted line, or while there is none, in proportion
        to the rows (0 before any step)."""
        line = self.fit()
        if line is not None:
            return line[0] + line[1] * rows
        _, total_rows, seconds = self._sums[:3]
        return seconds / total_rows * rows if total_rows else 0.0


def proposals_pay(
    acceptance: float, line: tuple[float, float] | None, drawing: int, rows: int, proposals: float, proposing_s: float
) -> bool:
    """Whether `proposals` tokens, made in `proposing_s` seconds and accepted at the share `acceptance`, raise
    the tokens per second of a step of `rows` rows where `drawing` sequences draw, when the target's step costs
    line = (a, b): a + b·rows seconds.

    The step yields drawing + acceptance·proposals tokens in a + b·(rows + proposals) + proposing_s seconds,
    against drawing tokens in a + b·rows: more per second iff
    acceptance·proposals·(a + b·rows) > drawing·(b·proposals + proposing_s). Unmeasured (None), they are taken
    to pay.
    """
    if line is None:
        return True
    return acceptance * proposals * (line[0] + line[1] * rows) > drawing * (line[1] * proposals + proposing_s)


class Speculator:
    """Gives a step's decoding chunks their proposals, where they pay (see the module's docstring)."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_seq_len: int) -> None:
        self._proposer = proposer
        self._k = num_tokens
        self._max_seq_len = max_seq_len
        self.counts = SpeculationCounts()
        self.cost = CostLine()  # the target's decode-only steps
        # Decayed over the steps that proposed; optimistic until measured:
        self.acceptance = 1.0  # the share of proposals accepted
        self.proposal_length = float(num_tokens)  # tokens proposed per sequence asked
        self.proposing = CostLine()  # the proposer's seconds against the sequences asked
        self._on = True  # whether proposals paid at the last step
        self._steps = 0  # since the last switch or probe
        self._probe_wait = _PROBE_EVERY  # steps between probes while proposals do not pay
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
        speculating = speculating[: self._asking(sum(c.samples for c in chunks), len(speculating))]
        if not speculating:
            return chunks
        started_at = time.monotonic()
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
        if asked:
            made = sum(len(c.proposed) for c in planned)
            self.proposal_length = _DECAY * self.proposal_length + (1 - _DECAY) * made / len(asked)
            self.proposing.add(len(asked), time.monotonic() - started_at)
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
        """The target computed a step in `seconds`: the acceptance learns from it, and the cost line from a step
        of `rows` decoding rows (None: a step with prompt chunks, whose rows cost otherwise)."""
        if rows is not None:
            self.cost.add(rows, seconds)
        if self._step_proposed:
            share = self._step_accepted / self._step_proposed
            self.acceptance = _DECAY * self.acceptance + (1 - _DECAY) * share
        self._step_proposed = self._step_accepted = 0

    def _asking(self, drawing: int, speculating: int) -> int:
        """How many of the `speculating` sequences of `drawing` propose this step: all where proposals pay, none
        where not, except for the probes that keep both kinds of step measured (the module's docstring). A probe
        where proposals do not pay asks one sequence, whose catching up is all a draft does. A change of mind
        is logged."""
        if not speculating:
            return 0
        line = self.cost.fit()
        proposals = self.proposal_length * speculating
        proposing_s = self.proposing.at(speculating)
        pays = proposals_pay(self.acceptance, line, drawing, drawing, proposals, proposing_s)
        if pays != self._on:
            self._on, self._steps, self._probe_wait = pays, 0, _PROBE_EVERY
            log.info(
                "speculation_switched",
                on=pays,
                acceptance=round(self.acceptance, 3),
                step_s=round(line[0], 6) if line else None,
                row_s=round(line[1], 7) if line else None,
                proposing_s=round(proposing_s, 6),
                proposals=round(proposals, 1),
                drawing=drawing,
            )
        self._steps += 1
        if self._steps < self._probe_wait:
            return speculating if pays else 0
        self._steps = 0
        if pays:
            return 0
        self._probe_wait = min(2 * self._probe_wait, _PROBE_MOST)
        return 1


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
