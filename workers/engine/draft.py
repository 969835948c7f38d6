"""A draft model's proposals (--speculative-model): a smaller model of the target's tokenizer proposes k tokens.

The draft runs on the engine's own code: a ModelRunner of its own, with a
paged KV cache of its own that holds as many tokens as the target's, and a
BlockManager used as an allocator only (a draft's blocks may hold proposals
the target rejects, so none is offered to other sequences as a cached prefix).
On a GPU the draft is loaded before the target's runner, which counts the
draft's weights, cache and steps before it sizes its own cache from the
memory free (model_runner.gpu_kv_cache_tokens): sized alone, the target's
cache took the memory the draft's then lacked.

Each speculating sequence has a draft sequence: the target's tokens, as far
as the draft has computed them. Before proposing, the draft sequence keeps
what it shares with the target's tokens (the proposals the target accepted
among them) and takes the tokens it lacks; then one step computes, for every
sequence at once, what it lacks and draws its first proposal, and k − 1
steps of one row each draw the rest. Proposals are the draft's greedy choice,
so they are a function of the tokens, as verification (speculation.py) wants
for a request's output to be the same on any worker with the same settings.
A sequence whose draft finds no room in its cache proposes nothing.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import structlog

from schemas.messages import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.model_runner import KVGeometry
from workers.engine.request import EngineRequest
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence

log = structlog.get_logger(__name__)
_GREEDY = SamplingParams(seed=0)


class DraftProposer:
    def __init__(self, draft: Any, target: Any, config: EngineConfig, target_tokens: int) -> None:
        """`draft` and `target`: LoadedModels (model_loader.py) on one device; the draft's cache holds
        `target_tokens` tokens."""
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError("the draft model's tokenizer is not the target's: its proposals would be other tokens")
        if draft.max_position_embeddings < config.max_seq_len:
            raise ValueError(
                f"the draft model reaches {draft.max_position_embeddings} positions, fewer than max_seq_len "
                f"{config.max_seq_len}"
            )
        tokens = max(target_tokens, config.max_seq_len)
        self._runner = draft.runner(config.for_draft(tokens * KVGeometry.of(draft.model).bytes_per_token))
        self._blocks = BlockManager(self._runner.num_blocks, config.block_size)
        self._drafts: dict[str, Sequence] = {}  # by request id
        self._synced: dict[str, int] = {}  # by request id: the target's tokens when last proposed for
        self._thread: int | None = None
        log.info(
            "draft_model_ready", blocks=self._runner.num_blocks, tokens=self._runner.num_blocks * config.block_size
        )

    def propose(self, sequences: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens proposed after sequences[i]'s."""
        if self._thread != threading.get_ident():  # the engine thread's, from its first step
            self._runner.bind_thread()
            self._thread = threading.get_ident()
        drafts = [self._synced_draft(sequence) for sequence in sequences]
        for draft, sequence in zip(drafts, sequences, strict=True):
            if draft is not None:  # the draft proposes within the target's grammar, from where the target is
                draft.matcher = sequence.matcher.deep_copy() if sequence.matcher is not None else None
        proposals: list[list[int]] = [[] for _ in sequences]
        for _ in range(max(ks, default=0)):
            chunks, proposing = [], []
            for index, draft in enumerate(drafts):
                if draft is None or len(proposals[index]) >= ks[index]:
                    continue
                if not self._blocks.can_grow(draft, draft.num_tokens):
                    drafts[index] = None
                    continue
                self._blocks.grow(draft, draft.num_tokens)
                chunks.append(Chunk(draft, draft.num_tokens - draft.num_cached_tokens))
                proposing.append(index)
            if not chunks:
                break
            output = self._runner.execute(chunks, chunks)
            for chunk, index, token in zip(chunks, proposing, output.tokens, strict=True):
                draft = chunk.sequence
                draft.num_cached_tokens = draft.num_tokens
                if token is None:  # the draft's logits were NaN: it proposes nothing more for this sequence
                    drafts[index] = None
                    continue
                draft.generated.append(token)
                if draft.matcher is not None:
                    draft.matcher.consume_token(token)
                proposals[index].append(token)
        return proposals

    def forget(self, sequence: Sequence) -> None:
        """The sequence has ended: its draft's blocks are free."""
        draft = self._drafts.pop(sequence.request_id, None)
        self._synced.pop(sequence.request_id, None)
        if draft is not None:
            self._blocks.free(draft)

    def _synced_draft(self, sequence: Sequence) -> Sequence | None:
        """The sequence's draft, holding the target's tokens; None if the draft's cache has no room for it."""
        tokens = sequence.token_ids
        draft = self._drafts.get(sequence.request_id)
        if draft is None:
            request = EngineRequest(
                request_id=sequence.request_id, sampling=_GREEDY, deadline=math.inf, prompt_token_ids=tokens
            )
            # A draft's tokens are never shown: no detokenizer, no stop strings.
            draft = Sequence(request, list(tokens), math.inf, None, None, sequence.received_at)
            if not self._blocks.can_allocate(draft):
                return None
            self._blocks.allocate(draft)
            self._drafts[sequence.request_id] = draft
        else:
            shared = self._synced[sequence.request_id]
            ours = draft.token_ids
            while shared < min(len(ours), len(tokens)) and ours[shared] == tokens[shared]:
                shared += 1
            del draft.generated[shared - len(draft.prompt_ids) :]  # its proposals the target did not take
            draft.num_cached_tokens = min(draft.num_cached_tokens, shared)
            self._blocks.shrink(draft, shared)
            draft.generated += tokens[shared:]
        self._synced[sequence.request_id] = len(tokens)
        return draft
