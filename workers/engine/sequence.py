"""One request inside the engine: its tokens, its place in the KV cache, its clocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from schemas.messages import ErrorInfo, FinishReason, TokenEvent, TokenInfo
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.request import EngineRequest
from workers.engine.step_output import Scored
from workers.engine.stop_strings import StopStrings

if TYPE_CHECKING:  # vision.py imports torch and pooling.py transformers, which a simulated worker does without
    from workers.engine.pooling import Pooling
    from workers.engine.vision import SequenceImages


class Status(Enum):
    WAITING = auto()  # not in the cache: new, or preempted and to be recomputed
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)  # one sequence is itself alone: the scheduler's lists find it by identity, not by its fields
class Sequence:
    request: EngineRequest
    prompt_ids: list[int]
    max_new_tokens: int  # left to generate: the request's, capped by the engine, less tokens_before
    detokenizer: IncrementalDetokenizer
    stop_strings: StopStrings
    received_at: float  # time.monotonic() when the worker took the request
    generated: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # leading tokens whose KV is in the cache
    waiting_since: float = field(default_factory=time.monotonic)  # for priority aging
    admitted_at: float | None = None  # first scheduled
    cached_prompt_tokens: int = 0  # of its prompt, found in the prefix cache when first scheduled
    admitted_urgency: float = 0.0  # its aged priority when last admitted (see Scheduler._victim)
    last_token_at: float | None = None
    preemptions: int = 0
    # Block index -> the prompt prefix hashes (request.py's PromptPrefixes) whose prefix ends in that block.
    prefix_marks: dict[int, list[int]] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    prompt_scores: list[Scored] = field(default_factory=list)  # [i] scores prompt token i + 1, when asked
    matcher: Any = None  # an llguidance LLMatcher when the request has a grammar (workers/engine/grammar.py)
    images: SequenceImages | None = None  # a vision-language model's prompt images (workers/engine/vision.py)
    # An embed request's: how its prompt's hidden states become its answer (workers/engine/pooling.py); None
    # for a request that generates.
    pooling: Pooling | None = None
    pooled_sum: Any = None  # mean pooling: its prompt rows' hidden states summed so far (a tensor)
    adapter: Any = None  # its LoRA adapter's HostAdapter (workers/engine/adapters.py); None: the base model
    lora_slot: int = -1  # the device slot it computes under while running; -1: none
    ngrams: Any = None  # prompt lookup's index of its n-grams (prompt_lookup.py); None until its first lookup

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt token's hidden state is needed (for the prompt's log-probabilities, or a mean
        pooled embedding), so that none may come from the prefix cache."""
        return self.request.sampling.prompt_logprobs is not None or (self.pooling is not None and self.pooling.mean)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without building token_ids."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.generated[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.generated[: end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def replay(self, token_ids: list[int]) -> None:
        """Take tokens an earlier attempt generated and delivered (a failover), as if generated here."""
        for token_id in token_ids:
            self.generated.append(token_id)
            self.stop_strings.feed(self.detokenizer.add(token_id))
        if self.matcher is not None:
            self.matcher.consume_tokens(token_ids)

    @property
    def grammar_done(self) -> bool:
        """Whether its grammar is complete: EOS is all it allows."""
        return self.matcher is not None and self.matcher.is_stopped()

    def _text(self, token_id: int | None, finish: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The text an event shows, and why the sequence ends (a stop string reached ends it)."""
        text = self.detokenizer.add(token_id) if token_id is not None else ""
        if finish is not None:
            text += self.detokenizer.flush()
        text, stopped = self.stop_strings.feed(text)
        if stopped:
            return text, FinishReason.STOP_SEQUENCE
        if finish is not None:
            text += self.stop_strings.flush()
        return text, finish

    def score_prompt(self, start: int, scores: list[Scored]) -> None:
        """The scores of prompt tokens start + 1, ... (a recomputation after a preemption scores them anew)."""
        del self.prompt_scores[start:]
        self.prompt_scores.extend(scores)

    def _token_info(self, token_id: int, scored: Scored | None) -> TokenInfo:
        decode = self.detokenizer.decode_one
        if scored is None:
            return TokenInfo(id=token_id, text=decode(token_id))
        top = [TokenInfo(id=i, text=decode(i), logprob=value) for i, value in scored.top]
        return TokenInfo(id=token_id, text=decode(token_id), logprob=scored.logprob, top=top)

    def _prompt_infos(self) -> list[TokenInfo]:
        scores = [None, *self.prompt_scores][: len(self.prompt_ids)]
        scores += [None] * (len(self.prompt_ids) - len(scores))  # a runner that scores no prompt (simulated)
        return [self._token_info(token_id, scored) for token_id, scored in zip(self.prompt_ids, scores, strict=True)]

    @property
    def next_index(self) -> int:
        """The request-wide index of the next token (recomputed tokens count)."""
        return self.request.tokens_before + len(self.generated)

    def append(
        self, token_id: int, scored: Scored | None, started_at: float, batch_size: int, finish: FinishReason | None
    ) -> TokenEvent:
        """Record a generated token (with its scores, when the request asks for them) and describe it as an event.

        `started_at` is when the step that computed it began. MindIE's
        queue_wait_time is, for the first token, the wait before the sequence
        was first scheduled, and for later ones the wait between its previous
        token and this step.
        """
        now = time.monotonic()
        first = self.last_token_at is None  # of this attempt, on this worker
        # A recomputed or failed-over request's first new token is not the request's first token.
        first_of_request = self.next_index == 0
        waited = ((self.admitted_at or started_at) - self.received_at) if first else started_at - self.last_token_at
        since_previous = now - (self.received_at if first else self.last_token_at)
        self.generated.append(token_id)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
        text, finish = self._text(token_id, finish)
        self.finish_reason = finish
        event = TokenEvent(
            request_id=self.request_id,
            attempt=self.request.attempt,
            index=self.next_index - 1,
            token_ids=[token_id],
            text=text,
            prompt_tokens=len(self.prompt_ids) if first else None,
            cached_prompt_tokens=self.cached_prompt_tokens if first else None,
            prompt=self._prompt_infos() if first and self.request.sampling.prompt_logprobs is not None else None,
            logprobs=None if scored is None else [self._token_info(token_id, scored)],
            prefill_time_ms=since_previous * 1000 if first_of_request else None,
            decode_time_ms=None if first_of_request else since_previous * 1000,
            queue_wait_us=int(max(0.0, waited) * 1e6),
            batch_size=batch_size,
            finish_reason=finish,
        )
        self.last_token_at = now
        return event

    def embedded(self, vector: list[float], batch_size: int) -> TokenEvent:
        """An embed request's one event: its pooled prompt, which ends it (finish length: it asks for no token)."""
        now = time.monotonic()
        self.finish_reason = FinishReason.LENGTH
        return TokenEvent(
            request_id=self.request_id,
            attempt=self.request.attempt,
            index=self.next_index,
            prompt_tokens=len(self.prompt_ids),
            embedding=vector,
            prefill_time_ms=(now - self.received_at) * 1000,
            queue_wait_us=int(max(0.0, (self.admitted_at or now) - self.received_at) * 1e6),
            batch_size=batch_size,
            finish_reason=self.finish_reason,
        )

    def stop(self, reason: FinishReason, error: ErrorInfo | None = None) -> TokenEvent:
        """End the sequence without a new token (cancelled, expired, failed)."""
        self.finish_reason = reason
        text, _ = self._text(None, reason)
        return TokenEvent(
            request_id=self.request_id,
            attempt=self.request.attempt,
            index=self.next_index,
            text=text,
            finish_reason=reason,
            error=error,
        )
