"""What runs in the next step: which sequences, and how many of their tokens.

Between steps the scheduler
- admits waiting sequences, most urgent first: priority 1 before 5, where a
  sequence gains one level for every `aging_s` it has waited, so priority 5
  is never starved; within a level, the tenant furthest below its fair share
  first (schemas/fair_share.py); admission stops at the first sequence that
  does not fit (batch size, or KV blocks), so nothing overtakes a more urgent one;
- makes room for an urgent sequence that does not fit (batch full, or KV
  blocks short) by preempting the least urgent running one (of a strictly
  lower priority, and of those the one of the tenant furthest over its share;
  aging does not preempt), or one of its own priority whose tenant is far
  over the sequence's (schemas/fair_share.py):
  its blocks are freed (their KV stays findable in the prefix cache) and it
  waits to be recomputed, seeing only a pause;
- spends a token budget per step: one token for each decoding sequence, the
  rest on prompt chunks, so that a long prompt does not stall everyone's
  decoding; except that the prompts of a priority above every decoding
  sequence's take a step alone, so that their first token comes sooner;
- gives a sequence of a LoRA adapter a device slot of it when it starts
  (adapters.py), and takes it back when it stops running; one whose adapter
  finds no slot waits, and the sequences behind it go ahead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas.fair_share import FairShare
from schemas.messages import aged_priority
from workers.engine.adapters import Adapters
from workers.engine.block_manager import BlockManager, block_content
from workers.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_tokens_per_step: int = 512
    aging_s: float = 10.0


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` tokens of `sequence`, from its first uncached one, computed this step; a decoding one may
    have tokens proposed after its last (speculation.py), computed with it and verified by the step's draws."""

    sequence: Sequence
    num_tokens: int
    proposed: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        """The rows it has in the step: its tokens, then the proposed ones."""
        return self.num_tokens + len(self.proposed)

    @property
    def reaches_end(self) -> bool:
        """Whether the chunk reaches the sequence's last token."""
        return self.sequence.num_cached_tokens + self.num_tokens == self.sequence.num_tokens

    @property
    def samples(self) -> bool:
        """Whether a new token is drawn after the chunk: it reaches the end of a sequence that generates (an
        embed request's prompt is pooled instead, workers/engine/pooling.py)."""
        return self.reaches_end and self.sequence.pooling is None


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters: Adapters | None = None) -> None:
        self._config = config
        self._blocks = blocks
        self._adapters = adapters
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0  # since start, for metrics and tests
        self.fair_share = FairShare()  # tokens served per tenant: prompts at first admission, outputs per step
        # Since start, at each sequence's first admission: its prompt, and what the prefix cache held of it.
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, sequence: Sequence) -> None:
        self.fair_share.arrived(sequence.request.tenant)
        self._wait(sequence)

    def _wait(self, sequence: Sequence) -> None:
        sequence.status = Status.WAITING
        sequence.waiting_since = time.monotonic()
        self.waiting.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Take a sequence out, finished or not, and free its blocks."""
        if sequence.status is Status.RUNNING:
            self.running.remove(sequence)
            self._blocks.free(sequence)
            self._release_slot(sequence)
        elif sequence.status is Status.WAITING:
            self.waiting.remove(sequence)
        if sequence.adapter is not None:
            self._adapters.unpin(sequence.adapter)
        if sequence.status is not Status.FINISHED:
            self.fair_share.left(sequence.request.tenant)
        sequence.status = Status.FINISHED

    def _release_slot(self, sequence: Sequence) -> None:
        if sequence.lora_slot >= 0:
            self._adapters.release(sequence.lora_slot)
            sequence.lora_slot = -1

    def _slot_ready(self, sequence: Sequence) -> bool:
        """Whether the sequence's adapter, if it has one, can have a device slot now."""
        return sequence.adapter is None or self._adapters.can_acquire(sequence.adapter)

    def _urgency(self, sequence: Sequence, now: float) -> float:
        return aged_priority(sequence.priority, now - sequence.waiting_since, self._config.aging_s)

    def _victim(self, priority: int, urgency: float) -> Sequence | None:
        """The running sequence to preempt for one of this priority and urgency, if any may be.

        Only a strictly more urgent priority preempts (aging orders the queue,
        it does not preempt), and never a sequence that aged its way in to be
        more urgent than the newcomer: it would starve.
        """
        eligible = [s for s in self.running if s.priority > priority and s.admitted_urgency > urgency]
        return max(eligible, key=self._preemption_order) if eligible else None

    def _fair_victim(self, candidate: Sequence) -> Sequence | None:
        """For a sequence a gateway sent past this worker's room, its tenant far below another's share as the
        gateway saw it (schemas/fair_share.py: the gateway sees each request whole, where this worker sees a
        tenant idle while its requests wait in the gateway): a running sequence of its priority and of another
        tenant, the newest of the tenant this worker has served most; else none."""
        if not candidate.request.preempt_for_share:
            return None
        tenant = candidate.request.tenant
        eligible = [s for s in self.running if s.priority == candidate.priority and s.request.tenant != tenant]
        return max(eligible, key=self._preemption_order) if eligible else None

    def _least_urgent_running(self) -> Sequence:
        return max(self.running, key=self._preemption_order)

    def _preemption_order(self, sequence: Sequence) -> tuple[int, float, float]:
        """Preempted first: the lowest priority; within it, the tenant furthest over its share; the newest."""
        return sequence.priority, self.fair_share.counter(sequence.request.tenant), sequence.received_at

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._blocks.free(sequence)
        self._release_slot(sequence)
        sequence.preemptions += 1
        self.preemptions += 1
        self._wait(sequence)

    def schedule(self) -> list[Chunk]:
        now = time.monotonic()
        self._admit(now)
        budget = self.step_budget
        chunks: list[Chunk] = []
        # Decoding sequences first (one token each), then prompt chunks; the most urgent first within each.
        order = sorted(
            self._urgent_prompts() or self.running,
            key=lambda s: (not _decodes(s), s.priority, s.received_at),
        )
        for sequence in order:
            if sequence.status is not Status.RUNNING or budget == 0:
                continue  # preempted below to make room for a more urgent one
            while not self._blocks.can_grow(sequence, sequence.num_tokens):
                victim = self._least_urgent_running()
                self._preempt(victim)
                if victim is sequence:
                    break
            if sequence.status is not Status.RUNNING:
                continue
            self._blocks.grow(sequence, sequence.num_tokens)
            num_tokens = min(sequence.num_tokens - sequence.num_cached_tokens, budget)
            chunks.append(Chunk(sequence, num_tokens))
            budget -= num_tokens
        chunks = [c for c in chunks if c.sequence.status is Status.RUNNING]
        for chunk in chunks:
            if chunk.samples:  # a token drawn for it: served to its tenant
                self.fair_share.charge(chunk.sequence.request.tenant, chunk.sequence.request.tenant_weight, 1)
        return chunks

    @property
    def step_budget(self) -> int:
        """Tokens a step computes at most: never fewer than a full batch's decodes."""
        return max(self._config.max_tokens_per_step, self._config.max_batch_size)

    def outranks_running(self, priority: int) -> bool:
        """Whether a request of this priority is more urgent than every running sequence."""
        return bool(self.running) and priority < min(s.priority for s in self.running)

    def _urgent_prompts(self) -> list[Sequence]:
        """The prompts of a priority above every decoding sequence's, if any: they get a step of their own.

        Their first token then waits for a step of their prompt alone, not for a
        whole batch's decoding as well; the others' next token waits one short
        step. Once these decode too, steps mix again.
        """
        prompts = [s for s in self.running if not _decodes(s)]
        decoding = [s.priority for s in self.running if _decodes(s)]
        if not prompts or not decoding:
            return []
        most_urgent = min(s.priority for s in prompts)
        return [s for s in prompts if s.priority == most_urgent] if most_urgent < min(decoding) else []

    def _admit(self, now: float) -> None:
        self.waiting.sort(
            key=lambda s: (*self.fair_share.order(s.request.tenant, self._urgency(s, now)), s.received_at)
        )
        deferred: list[Sequence] = []
        while self.waiting:
            candidate = self.waiting.pop(0)
            if self._twin_computing(candidate) or not self._slot_ready(candidate):
                deferred.append(candidate)
                continue
            urgency = self._urgency(candidate, now)
            while len(self.running) >= self._config.max_batch_size or not self._blocks.can_allocate(candidate):
                victim = self._victim(candidate.priority, urgency) or self._fair_victim(candidate)
                if victim is None:
                    self.waiting.insert(0, candidate)
                    self.waiting += deferred
                    return  # nothing less urgent to make room with: wait, and let nothing overtake
                self._preempt(victim)
            self._start(candidate, urgency, now)
        self.waiting = deferred

    def _twin_computing(self, candidate: Sequence) -> bool:
        """Whether a running sequence is computing the same first block of prompt (an OpenAI `n` sibling, or
        the same prompt sent twice): the candidate waits for it, and then takes that prompt's KV from the
        prefix cache rather than computing it again."""
        size = self._blocks.block_size
        if len(candidate.prompt_ids) <= size or candidate.computes_whole_prompt:
            return False
        head = block_content(candidate, 0, size)  # an image there counts: another image is another block
        return any(s.num_cached_tokens < size and block_content(s, 0, size) == head for s in self.running)

    def start_beside(self, sequence: Sequence) -> Chunk | None:
        """Start a waiting sequence while a step of others runs; its first chunk, or None if it must wait.

        It takes free blocks only, and a slot beyond the batch size if need be
        (until a running sequence ends): preempting one of the running step
        would hand out blocks that step is writing.
        """
        if not self._blocks.can_allocate(sequence) or not self._slot_ready(sequence):
            return None
        now = time.monotonic()
        self.waiting.remove(sequence)
        self._start(sequence, self._urgency(sequence, now), now)
        return Chunk(sequence, min(sequence.num_tokens - sequence.num_cached_tokens, self.step_budget))

    def _start(self, sequence: Sequence, urgency: float, now: float) -> None:
        sequence.admitted_urgency = urgency
        self._blocks.allocate(sequence)
        if sequence.adapter is not None:
            sequence.lora_slot = self._adapters.acquire(sequence.adapter, sequence.request.evict_adapters_first)
        sequence.status = Status.RUNNING
        self.running.append(sequence)
        if sequence.admitted_at is None:
            sequence.admitted_at = now
            self.fair_share.charge(sequence.request.tenant, sequence.request.tenant_weight, len(sequence.prompt_ids))
            sequence.cached_prompt_tokens = min(sequence.num_cached_tokens, len(sequence.prompt_ids))
            self.prompt_tokens += len(sequence.prompt_ids)
            self.cached_prompt_tokens += sequence.cached_prompt_tokens


def _decodes(sequence: Sequence) -> bool:
    """Whether only its last token lacks KV: its step computes one token (else a prompt, or a recomputation)."""
    return sequence.num_tokens - sequence.num_cached_tokens <= 1
