"""The requests a gateway waits for, and the demultiplexing of its reply topic.

Every worker sends a gateway's events to that gateway's one reply topic; the
registry hands each event to the request it belongs to, in token order: an
event of another attempt (a request re-published after a failure), or one
already delivered, is dropped; one that skips tokens (some were lost) breaks
the request, which then fails over. The registry also follows which worker
runs each request, from its events and from the workers' heartbeats.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from bus.prefixes import prefix_hashes
from schemas.messages import (
    INCOMPLETE_GENERATION,
    TIMEOUT,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenEvents,
    WorkerHeartbeat,
)
from telemetry.metrics import RequestTimer, metrics_of

# How long past its deadline a request waits for the worker's own timeout
# event before the gateway ends it itself (it may still wait in a topic).
DEADLINE_GRACE_S = 0.1
# Heartbeats in a row of its live worker that do not list a request: it was
# lost there (its last events went missing). One is not enough: a heartbeat
# may overtake the request's last event, which travels on another topic.
UNLISTED_HEARTBEATS = 2


class InFlight:
    def __init__(self, request: GenerationRequest, client_id: str) -> None:
        self.request = request
        self.client_id = client_id  # the id the client knows it by
        self.finished = False  # its last event was handed out
        self.worker_ended = False  # a worker said it is done with it (else it may still run)
        self.timer = RequestTimer(metrics_of("gateway"), request)
        self.received: list[int] = []  # tokens delivered, every attempt's: a failover goes on after them
        self.worker_id: str | None = None  # the worker running the current attempt, once known
        self.broke_off_on: str | None = None  # the worker of the previous attempt: a failover avoids it
        self.unlisted = 0  # heartbeats in a row of that worker that did not list it
        # Told the tokens its events bring (its prompt's once, whatever the attempts, and each generated one).
        self.on_tokens: Callable[[int], None] | None = None
        self.prepaid_tokens = 0  # charged to its tenant's fair share when sent, before its worker counted them
        # Awaited with its last event, before the client gets it (its usage record: gateway/tenancy/usage.py).
        self.on_end: Callable[[TokenEvent], Awaitable[None]] | None = None
        # Its prompt's tokens, and of them those found cached, as its first worker counted them (the worker it
        # fails over to counts the tokens generated before as prompt too).
        self.prompt_tokens: int | None = None
        self.cached_prompt_tokens = 0
        self.first_token_at: float | None = None  # time.time()
        self.stopped = False  # by stopInfer
        self.usage_recorded = False  # its usage record is made (once: at its end, or when it is dropped)
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    @functools.cached_property
    def prefix_hashes(self) -> list[int]:
        """The names of its prompt's prefixes (bus/prefixes.py), the same for every attempt: computed once."""
        return prefix_hashes(self.request)

    def deliver(self, event: TokenEvent, worker_id: str) -> None:
        self.worker_id = worker_id
        self.unlisted = 0
        self.received.extend(event.token_ids)
        self._events.put_nowait(event)

    @property
    def next_index(self) -> int:
        """The request-wide index of the next token the client expects."""
        return self.request.tokens_before + len(self.received)

    def routed_to(self, worker_id: str | None) -> None:
        """The current attempt was published to this worker's inbox (None: to the shared queue)."""
        if worker_id is not None:
            self.worker_id = worker_id
            self.unlisted = 0

    def attempt_again(self) -> GenerationRequest:
        """Make the current attempt stale and return the next one, which goes on from the delivered tokens."""
        self.request = self.request.model_copy(
            update={"attempt": self.request.attempt + 1, "generated_token_ids": list(self.received)}
        )
        self.broke_off_on = self.worker_id or self.broke_off_on
        self.worker_id = None
        self.unlisted = 0
        return self.request

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's events up to and including its last; never waits past the deadline."""
        while not self.finished:
            remaining = self.request.deadline + DEADLINE_GRACE_S - time.time()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    event = await self._events.get()
                self.worker_ended = event.finish_reason is not None or event.error is not None
                self.finished = self.worker_ended
                self._count_tokens(event)
            except TimeoutError:
                event = self._expired()
                self.finished = True
            if self.finished and self.on_end is not None:
                await self.on_end(event)
            self.timer.event(event, time.time())
            yield event

    def _count_tokens(self, event: TokenEvent) -> None:
        prompt = 0
        if self.prompt_tokens is None and event.prompt_tokens is not None:
            prompt = self.prompt_tokens = event.prompt_tokens
            self.cached_prompt_tokens = event.cached_prompt_tokens or 0
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        if self.on_tokens is not None and (counted := prompt + len(event.token_ids)):
            self.on_tokens(counted)

    def stop_unstarted(self) -> None:
        """End a request that no worker has (it waited in the gateway) as stopped, like a cancel does."""
        self._end_here(FinishReason.STOP_SEQUENCE)

    def fail(self, message: str) -> None:
        """End the request with an error event of the gateway's own (no worker will answer it)."""
        self._end_here(
            FinishReason.INVALID_FLAG, ErrorInfo(message=message, error_type=INCOMPLETE_GENERATION, status=500)
        )

    def _end_here(self, reason: FinishReason, error: ErrorInfo | None = None) -> None:
        event = TokenEvent(
            request_id=self.request.request_id,
            attempt=self.request.attempt,
            index=self.next_index,
            finish_reason=reason,
            error=error,
        )
        self._events.put_nowait(event)

    def _expired(self) -> TokenEvent:
        return TokenEvent(
            request_id=self.request.request_id,
            attempt=self.request.attempt,
            index=0,
            finish_reason=FinishReason.STOP_SEQUENCE,
            error=ErrorInfo(
                message=f"request {self.request.request_id} exceeded its timeout", error_type=TIMEOUT, status=504
            ),
        )


@dataclass
class Routed:
    """What became of one message of events."""

    unwanted: list[TokenEvent] = field(default_factory=list)  # nobody waits for them: stop their generation
    broken: list[InFlight] = field(default_factory=list)  # tokens went missing: fail over
    prefilled: list[InFlight] = field(default_factory=list)  # first tokens came: the worker holds their prompts


class InFlightRegistry:
    def __init__(self) -> None:
        self._requests: dict[str, InFlight] = {}

    def open(self, request: GenerationRequest, client_id: str) -> InFlight:
        inflight = InFlight(request, client_id)
        self._requests[request.request_id] = inflight
        return inflight

    def find(self, model: str, client_id: str) -> list[InFlight]:
        """The requests for `model` that the client calls `client_id`."""
        return [f for f in self._requests.values() if f.client_id == client_id and f.request.model == model]

    def get(self, request_id: str) -> InFlight | None:
        return self._requests.get(request_id)

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(list(self._requests.values()))

    def deliver(self, batch: TokenEvents) -> Routed:
        routed = Routed()
        for event in batch.events:
            inflight = self._requests.get(event.request_id)
            if inflight is None or inflight.finished or event.attempt != inflight.request.attempt:
                routed.unwanted.append(event)
            elif event.index > inflight.next_index:
                if inflight not in routed.broken:
                    routed.broken.append(inflight)
            elif event.index == inflight.next_index or not event.token_ids:  # else delivered already
                inflight.deliver(event, batch.worker_id)
                if event.prompt_tokens is not None and event.token_ids:
                    routed.prefilled.append(inflight)
        return routed

    def observe(self, heartbeat: WorkerHeartbeat) -> list[InFlight]:
        """Learn who runs what from a live worker's heartbeat; return the requests it lost."""
        lost = []
        for inflight in self._requests.values():
            if heartbeat.requests.get(inflight.request.request_id) == inflight.request.attempt:
                inflight.worker_id = heartbeat.worker_id
                inflight.unlisted = 0
            elif inflight.worker_id == heartbeat.worker_id and not inflight.finished:
                inflight.unlisted += 1
                if inflight.unlisted >= UNLISTED_HEARTBEATS:
                    lost.append(inflight)
        return lost

    def handed_back(self, heartbeat: WorkerHeartbeat) -> list[InFlight]:
        """The requests a draining worker says it will not run (their current attempt)."""
        return [
            inflight
            for request_id, attempt in heartbeat.handed_back.items()
            if (inflight := self._requests.get(request_id)) is not None
            and inflight.request.attempt == attempt
            and not inflight.finished
        ]
