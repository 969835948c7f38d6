"""Requests whose worker died or lost them go on elsewhere, from the last token delivered.

The gateway knows which worker runs each of its requests (its events, the
workers' heartbeats). A request fails over when its worker said goodbye or
went silent while the control topic worked, when a live worker stops listing
it, or when its events skip tokens. Failing over re-publishes it as a
recomputation: a new attempt number, the prompt and the tokens already
delivered, routed to another worker; a cancel fences the old attempt on
every worker first, so the copy Kafka delivers again once the dead worker's
partitions move is skipped.
Events that nobody waits for (an old attempt, a request already answered)
are answered with a cancel, so that no worker keeps generating them.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from prometheus_client import Counter

from bus.base import Bus, BusUnavailable, UnknownTopic
from bus.peers import PeerClock
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.inflight import InFlight, InFlightRegistry
from schemas.messages import CancelRequest, TokenEvent, TokenEvents, WorkerHeartbeat
from telemetry.metrics import snake

log = structlog.get_logger(__name__)

FAILOVERS = Counter(
    "tokenrelay_gateway_failovers",
    "Requests re-published to continue on another worker, by why their attempt broke off.",
    ["model", "reason"],
)
# Why an attempt broke off: FAILOVERS' reasons.
TOKENS_LOST = "tokens lost"
HANDED_BACK = "handed back by a draining worker"
LOST_BY_WORKER = "lost by its worker"
WORKER_GONE = "worker gone"
REASONS = (TOKENS_LOST, HANDED_BACK, LOST_BY_WORKER, WORKER_GONE)
# Two heartbeats and a half: a worker's death is noticed 1.5-2.5 s after it (checked every CHECK_EVERY_S).
WORKER_SILENCE_S = 2.5
CHECK_EVERY_S = 0.25
MAX_ATTEMPTS = 8  # past this many, a request ends with an error rather than fail over forever
_REMEMBER_S = 600.0  # gone workers, and the unwanted events already answered
_RECANCEL_AFTER_S = 5.0  # a cancel for unwanted events is sent again if they keep coming this long after


def count_from_zero(model: str) -> None:
    """Export the model's failovers at 0, for every reason, until they happen (as telemetry/metrics.py's)."""
    for reason in REASONS:
        FAILOVERS.labels(model, snake(reason))


class Failover:
    def __init__(
        self,
        bus: Bus,
        registry: InFlightRegistry,
        control_topic: str,
        dispatcher: Dispatcher,
        heartbeat_interval_s: float,
        stuck_after_s: float,
    ):
        self._bus = bus
        self._registry = registry
        self._control_topic = control_topic
        self._dispatcher = dispatcher
        # The workers, as the gateway's control listener hears them (and the gateway's own heartbeats).
        self.workers = PeerClock(heartbeat_interval_s, WORKER_SILENCE_S, stuck_after_s, _REMEMBER_S)
        self._cancelled: dict[tuple[str, int], float] = {}  # (request id, attempt) -> when told to stop
        self._publishing: dict[str, asyncio.Task] = {}  # request id -> its failover being published
        self._unpublished: set[InFlight] = set()  # failed over, but the bus refused it: tried again each check
        self._cancelling: set[asyncio.Task] = set()

    def on_events(self, batch: TokenEvents) -> list[InFlight]:
        """Deliver a worker's events; the requests whose first tokens they bring (the worker holds their prompts)."""
        routed = self._registry.deliver(batch)
        for event in routed.unwanted:
            self._stop_unwanted(event)
        for inflight in routed.broken:
            self._fail_over(inflight, TOKENS_LOST)
        return routed.prefilled

    def on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        for inflight in self._registry.handed_back(heartbeat):
            self._fail_over(inflight, HANDED_BACK)
        for inflight in self._registry.observe(heartbeat):
            self._fail_over(inflight, LOST_BY_WORKER)

    def check(self) -> None:
        """Every heartbeat interval: fail over the requests of gone workers, publish what could not be."""
        now = time.monotonic()
        for inflight in self._registry:
            if inflight.worker_id is not None and not inflight.finished and self.workers.gone(inflight.worker_id, now):
                self._fail_over(inflight, WORKER_GONE)
        for inflight in list(self._unpublished):
            self._publish(inflight)
        self.workers.forget_old(now)
        self._cancelled = {key: at for key, at in self._cancelled.items() if now - at < _REMEMBER_S}

    def forget(self, inflight: InFlight, told_to_stop: bool) -> None:
        """The gateway is done with the request; `told_to_stop`: a cancel for it is on its way."""
        if told_to_stop:
            self._cancelled[(inflight.request.request_id, inflight.request.attempt)] = time.monotonic()
        self._unpublished.discard(inflight)

    def _fail_over(self, inflight: InFlight, reason: str) -> None:
        worker = inflight.worker_id
        if inflight.request.attempt + 1 >= MAX_ATTEMPTS:
            log.error("request_abandoned", **inflight.request.log_ids(), reason=reason, worker_id=worker)
            inflight.fail(f"generation broke off {MAX_ATTEMPTS} times; last: {reason}")
            return
        request = inflight.attempt_again()
        FAILOVERS.labels(request.model, snake(reason)).inc()
        log.warning(
            "request_failing_over",
            **request.log_ids(),
            attempt=request.attempt,
            delivered_tokens=len(request.generated_token_ids),
            structured=request.sampling.grammar is not None,
            worker_id=worker,
            reason=reason,
        )
        self._publish(inflight)

    def _publish(self, inflight: InFlight) -> None:
        running = self._publishing.get(inflight.request.request_id)
        if running is None or running.done():  # else it publishes the latest attempt before it ends
            self._publishing[inflight.request.request_id] = asyncio.create_task(self._publish_latest(inflight))

    async def _publish_latest(self, inflight: InFlight) -> None:
        """Fence the old attempts, then publish the current one; again if it failed over meanwhile."""
        while True:
            request = inflight.request
            fence = CancelRequest(
                request_id=request.request_id,
                reason="failed over",
                deadline=request.deadline,
                attempts_before=request.attempt,
            )
            try:
                await self._bus.publish(self._control_topic, fence)
                await self._dispatcher.dispatch(inflight)
            except (BusUnavailable, UnknownTopic) as error:
                log.warning("failover_not_published", **request.log_ids(), error=str(error))
                self._unpublished.add(inflight)
                return
            if inflight.request is request:
                self._unpublished.discard(inflight)
                self._publishing.pop(request.request_id, None)
                return

    def _stop_unwanted(self, event: TokenEvent) -> None:
        key = (event.request_id, event.attempt)
        now = time.monotonic()
        if now - self._cancelled.get(key, -_RECANCEL_AFTER_S) < _RECANCEL_AFTER_S:
            return
        self._cancelled[key] = now
        waiting = self._registry.get(event.request_id)
        cancel = CancelRequest(
            request_id=event.request_id,
            reason="nobody waits",
            deadline=time.time() + _REMEMBER_S,
            # Only the stale attempts of a request still waited for.
            attempts_before=None if waiting is None or waiting.finished else waiting.request.attempt,
        )
        task = asyncio.create_task(self._bus.publish_or_log(self._control_topic, cancel, "cancel_not_published"))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)
