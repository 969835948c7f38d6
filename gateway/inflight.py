"""The requests a gateway waits for, and the demultiplexing of its reply topic.

Every worker sends a gateway's events to that gateway's one reply topic; the
registry hands each event to the request it belongs to. Events of another
attempt of a request (one that was re-published after a failure) are dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from schemas.messages import ErrorInfo, FinishReason, GenerationRequest, TokenEvent, TokenEvents
from tokenrelay.metrics import RequestTimer, metrics_of

# How long past its deadline a request waits for the worker's own timeout
# event before the gateway ends it itself (it may still wait in a topic).
DEADLINE_GRACE_S = 0.1


class InFlight:
    def __init__(self, request: GenerationRequest, client_id: str) -> None:
        self.request = request
        self.client_id = client_id  # the id the client knows it by
        self.finished = False  # its last event was handed out
        self.worker_ended = False  # a worker said it is done with it (else it may still run)
        self.timer = RequestTimer(metrics_of("gateway"), request)
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def deliver(self, event: TokenEvent) -> None:
        self._events.put_nowait(event)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's events up to and including its last; never waits past the deadline."""
        while not self.finished:
            remaining = self.request.deadline + DEADLINE_GRACE_S - time.time()
            try:
                event = await asyncio.wait_for(self._events.get(), max(remaining, 0.0))
                self.worker_ended = event.finish_reason is not None or event.error is not None
                self.finished = self.worker_ended
            except TimeoutError:
                event = self._expired()
                self.finished = True
            self.timer.event(event, time.time())
            yield event

    def _expired(self) -> TokenEvent:
        return TokenEvent(
            request_id=self.request.request_id,
            attempt=self.request.attempt,
            index=0,
            finish_reason=FinishReason.STOP_SEQUENCE,
            error=ErrorInfo(
                message=f"request {self.request.request_id} exceeded its timeout", error_type="Timeout", status=504
            ),
        )


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

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def deliver(self, batch: TokenEvents) -> None:
        for event in batch.events:
            inflight = self._requests.get(event.request_id)
            if inflight is not None and event.attempt == inflight.request.attempt:
                inflight.deliver(event)
