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

When proposals pay, and when not: speculation_rule.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.prompt_lookup import NgramProposer
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence
from workers.engine.speculation_rule import SpeculationRule

SPECULATIVE_METHODS = ("ngram", "draft")


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


class Speculator:
    """Gives a step's decoding chunks their proposals, where they pay (see the module's docstring)."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_seq_len: int, always: bool = False) -> None:
        self._proposer = proposer
        self._k = num_tokens
        self._max_seq_len = max_seq_len
        self.counts = SpeculationCounts()
        self.rule = SpeculationRule(num_tokens, always)

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
        speculating = speculating[: self.rule.asking(sum(c.samples for c in chunks), len(speculating))]
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
            self.rule.proposed(len(asked), sum(len(c.proposed) for c in planned), time.monotonic() - started_at)
        return planned

    def forget(self, sequence: Sequence) -> None:
        """The sequence has ended."""
        self._proposer.forget(sequence)

    def settled(self, proposed: int, accepted: int) -> None:
        """One sequence's proposals were verified: `accepted` of `proposed` taken."""
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        self.counts.verifications += 1
        self.rule.settled(proposed, accepted)


def load_draft(config: EngineConfig, target: Any) -> Any:
    """The draft model an EngineConfig asks for, on the target's device and in its dtype (None: no draft); loaded
    before the target's runner, which leaves the draft's cache and steps their room (draft.py)."""
    if config.speculative != "draft":
        return None
    from workers.engine.model_loader import load_model  # it imports torch, which a simulated worker does without

    dtype = str(target.model.dtype).removeprefix("torch.")
    return load_model(config.speculative_model, str(target.device), dtype)


def speculator_for(config: EngineConfig, target: Any, target_tokens: int, draft: Any = None) -> Speculator | None:
    """The speculator an EngineConfig asks for (None: no speculation); `target`: the LoadedModel it serves, whose
    KV cache holds `target_tokens` tokens (a draft model's holds as many); `draft`: load_draft's model."""
    if not config.speculative:
        return None
    if config.speculative == "ngram":
        proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
    elif config.speculative == "draft":
        from workers.engine.draft import DraftProposer  # it imports torch, which a simulated worker does without

        proposer = DraftProposer(draft, target, config, target_tokens)
    else:
        raise ValueError(f"speculative {config.speculative!r} is none of {', '.join(SPECULATIVE_METHODS)}")
    return Speculator(proposer, config.num_speculative_tokens, config.max_seq_len, config.speculative_always)
