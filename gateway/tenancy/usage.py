"""Usage metered exactly once: one record per request on the usage topic, for billing.

The gateway that answers a request publishes its record (tenant, key id,
model or adapter, prompt, cached prompt and output tokens, timings, outcome)
before the client gets the request's last event, so that a client that saw an
end always has its record; a client that leaves first (or a stopInfer, or a
timeout) has one too, published as the request is dropped. Only the gateway
publishes, once per request, however many workers ran it: a failover never
counts twice. The topic is keyed by request id and compacted, and
`tokenrelay usage` keeps one record per key, so a record a producer's retry
sent twice still counts once.

A record the bus does not take is kept and sent again every RETRY_S until it
is, and on a clean stop: the answer does not wait for a broker that is away.
What a gateway killed mid-request had not recorded is lost with its client's
connection; that client saw no end.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from bus.base import Bus, BusUnavailable, UnknownTopic
from gateway.dispatch.inflight import InFlight
from schemas.messages import TIMEOUT, TokenEvent, UsageOutcome, UsageRecord

log = structlog.get_logger(__name__)

RETRY_S = 1.0


def outcome_of(inflight: InFlight, last: TokenEvent | None) -> UsageOutcome:
    """How the request ended: its last event's say, or (None) dropped before its end: cancelled."""
    if last is None or inflight.stopped:
        return "cancelled"
    if last.error is not None:
        return "timed_out" if last.error.error_type == TIMEOUT else "failed"
    return "finished"


class UsageMeter:
    def __init__(self, bus: Bus, topic: str, gateway_id: str) -> None:
        self._bus = bus
        self.topic = topic
        self._gateway_id = gateway_id
        self._unsent: list[UsageRecord] = []

    def record(self, inflight: InFlight, last: TokenEvent | None, key_id: str | None) -> UsageRecord | None:
        """The request's record, the first time it is asked for; None after that."""
        if inflight.usage_recorded:
            return None
        inflight.usage_recorded = True
        request = inflight.request
        return UsageRecord(
            request_id=request.request_id,
            trace_id=request.trace_id,
            tenant=request.tenant,
            key_id=key_id,
            model=request.model,
            adapter=request.adapter,
            task=request.task,
            prompt_tokens=inflight.prompt_tokens or 0,
            cached_prompt_tokens=inflight.cached_prompt_tokens,
            output_tokens=len(inflight.received),
            arrival=request.arrival,
            first_token_at=inflight.first_token_at,
            ended_at=time.time(),
            outcome=outcome_of(inflight, last),
            attempts=request.attempt + 1,
            gateway_id=self._gateway_id,
        )

    async def publish(self, record: UsageRecord) -> None:
        """Publish now; if the bus refuses, keep it for a later try."""
        if not await self._send(record):
            self._unsent.append(record)

    async def _send(self, record: UsageRecord) -> bool:
        try:
            await self._bus.publish(self.topic, record, key=record.request_id)
        except (BusUnavailable, UnknownTopic) as error:
            log.warning(
                "usage_not_published", request_id=record.trace_id, generation_id=record.request_id, error=str(error)
            )
            return False
        log.info(
            "usage_recorded",
            **record.model_dump(include={"tenant", "model", "outcome", "output_tokens"}),
            request_id=record.trace_id,
            generation_id=record.request_id,
        )
        return True

    async def resend(self) -> None:
        """Send the records the bus refused, oldest first, until one is refused again."""
        while self._unsent and await self._send(self._unsent[0]):
            self._unsent.pop(0)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            await self.resend()
