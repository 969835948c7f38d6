"""One request inside the engine: its tokens, its cache, its clocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from transformers import LogitsProcessorList

from schemas.messages import ErrorInfo, FinishReason, GenerationRequest, TokenEvent
from workers.engine.detokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    request: GenerationRequest
    prompt_ids: list[int]
    max_new_tokens: int  # left to generate: the request's, capped by the engine, less tokens_before
    processors: LogitsProcessorList
    detokenizer: IncrementalDetokenizer
    received_at: float  # time.monotonic() when the worker took the request
    admitted_at: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    kv_cache: Any = None  # the model runner's, for this sequence alone
    last_token_at: float | None = None
    finish_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def next_index(self) -> int:
        """The request-wide index of the next token (recomputed tokens count)."""
        return self.request.tokens_before + len(self.generated)

    def append(self, token_id: int, started_at: float, batch_size: int, finish: FinishReason | None) -> TokenEvent:
        """Record a generated token and describe it as an event.

        `started_at` is when the step that computed it began for this sequence:
        the wait before it is what MindIE reports as queue_wait_time.
        """
        now = time.monotonic()
        first = not self.generated
        # A recomputed request's first new token is not the request's first token.
        first_of_request = first and self.request.tokens_before == 0
        waited_since = self.admitted_at if first else self.last_token_at
        since_previous = now - (self.received_at if first else self.last_token_at)
        self.generated.append(token_id)
        text = self.detokenizer.add(token_id)
        if finish is not None:
            self.finish_reason = finish
            text += self.detokenizer.flush()
        event = TokenEvent(
            request_id=self.request_id,
            attempt=self.request.attempt,
            index=self.next_index - 1,
            token_ids=[token_id],
            text=text,
            prompt_tokens=len(self.prompt_ids) if first else None,
            prefill_time_ms=since_previous * 1000 if first_of_request else None,
            decode_time_ms=None if first_of_request else since_previous * 1000,
            queue_wait_us=int(max(0.0, started_at - waited_since) * 1e6),
            batch_size=batch_size,
            finish_reason=finish,
        )
        self.last_token_at = now
        return event

    def stop(self, reason: FinishReason, error: ErrorInfo | None = None) -> TokenEvent:
        """End the sequence without a new token (cancelled, expired, failed)."""
        self.finish_reason = reason
        return TokenEvent(
            request_id=self.request_id,
            attempt=self.request.attempt,
            index=self.next_index,
            text=self.detokenizer.flush(),
            finish_reason=reason,
            error=error,
        )
