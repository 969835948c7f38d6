"""A worker: takes requests of its model from the bus, runs them, streams the tokens back.

It takes only what its engine can start now, most urgent first: a free slot,
or the slot of a running request of a lower priority, which the engine then
preempts. Expired and cancelled requests are dropped when they are taken; each
request is acknowledged once its last event is published. Every engine
step's events leave as one message per gateway. Heartbeats on the control
topic tell gateways that it lives and what it serves; cancellations arrive
there too.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from bus.base import Bus, BusUnavailable, Delivery, Listener, RequestQueue, UnknownTopic
from bus.topics import control_topic, request_topics, worker_group
from schemas.messages import (
    CancelRequest,
    ErrorInfo,
    FinishReason,
    ServedModel,
    TokenEvent,
    TokenEvents,
    WorkerHeartbeat,
)
from tokenrelay.metrics import RequestTimer, metrics_of, record_backlog
from workers.engine.engine import Engine, EngineConfig
from workers.engine.model_runner import LoadedModel

log = structlog.get_logger(__name__)

TOKENS_AFTER_CANCEL = Counter(
    "tokenrelay_worker_tokens_after_cancel",
    "Tokens generated for requests after their cancellation reached the worker (at most one step's worth).",
    ["model"],
)
_BACKLOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    topic_prefix: str = "tokenrelay"
    partitions: int = 8  # per request topic: up to this many workers share a priority
    heartbeat_interval_s: float = 1.0


@dataclass
class _Taken:
    """A request this worker runs."""

    delivery: Delivery
    timer: RequestTimer
    cancelled: bool = False

    @property
    def priority(self) -> int:
        return self.delivery.request.priority


class Worker:
    def __init__(
        self,
        bus: Bus,
        loaded: LoadedModel,
        config: EngineConfig,
        served_names: list[str],
        settings: WorkerSettings,
    ) -> None:
        self._bus = bus
        self._settings = settings
        self._config = config
        self._engine = Engine(loaded, config, self._on_engine_step)
        self.model = ServedModel(
            name=served_names[0],
            aliases=served_names,
            max_seq_len=config.max_seq_len,
            max_input_len=self._engine.max_input_len,
            max_iter_times=config.max_iter_times,
            vocab_size=loaded.vocab_size,
        )
        self._metrics = metrics_of("worker")
        self._topics = request_topics(settings.topic_prefix, self.model.name)
        self._group = worker_group(settings.topic_prefix, self.model.name)
        self._control_topic = control_topic(settings.topic_prefix)
        self._active: dict[str, _Taken] = {}  # request id -> the request running here
        self._cancelled: dict[str, float] = {}  # cancelled before it was taken: request id -> its deadline
        self._drops: list[tuple[Delivery, ErrorInfo | None]] = []  # taken only to be dropped, and why
        self._steps: asyncio.Queue[list[TokenEvent]] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: RequestQueue | None = None
        self._control: Listener | None = None

    async def start(self) -> None:
        """Create the topics, join the request group, start the engine."""
        self._loop = asyncio.get_running_loop()
        partitions = {topic: self._settings.partitions for topic in self._topics}
        await self._bus.create_topics({**partitions, self._control_topic: 1})
        self._control = await self._bus.listen(self._control_topic)
        self._queue = await self._bus.open_request_queue(self._topics, self._group, self._config.aging_s)
        self._engine.start()
        log.info("worker_started", worker_id=self._settings.worker_id, model=self.model.name, group=self._group)

    async def run(self) -> None:
        """Serve until cancelled, or until a part of the worker fails."""
        assert self._queue is not None and self._control is not None
        tasks = [
            asyncio.create_task(self._take_requests(self._queue), name="take-requests"),
            asyncio.create_task(self._publish_events(self._queue), name="publish-events"),
            asyncio.create_task(self._follow_control(self._control), name="follow-control"),
            asyncio.create_task(self._send_heartbeats(), name="heartbeats"),
            asyncio.create_task(self._measure_backlog(), name="measure-backlog"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises what ended it
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stop(self) -> None:
        try:
            await self._bus.publish(self._control_topic, self._heartbeat(leaving=True))
        except (BusUnavailable, UnknownTopic) as error:
            log.warning("leaving_not_announced", error=str(error))
        self._engine.stop()
        if self._queue is not None:
            await self._queue.close()
        if self._control is not None:
            await self._control.close()

    # -- engine thread -> event loop

    def _on_engine_step(self, events: list[TokenEvent]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._steps.put_nowait, events)

    # -- taking requests

    async def _take_requests(self, queue: RequestQueue) -> None:
        while True:
            if not self._engine.alive():
                raise RuntimeError("the engine thread died")
            await queue.take(self._take_on, timeout_s=0.02)
            drops, self._drops = self._drops, []
            for delivery, error in drops:
                if error is not None:
                    expired = TokenEvent(
                        request_id=delivery.request.request_id,
                        attempt=delivery.request.attempt,
                        index=0,
                        finish_reason=FinishReason.STOP_SEQUENCE,
                        error=error,
                    )
                    await self._publish(delivery.request.reply_to, [expired])
                queue.finished(delivery)

    def _take_on(self, delivery: Delivery) -> bool:
        """Whether to take a request now (`RequestQueue.take`'s accept): to start it, or to drop it."""
        request = delivery.request
        if request.request_id in self._active:  # delivered again while it runs here
            self._drops.append((delivery, None))
        elif request.request_id in self._cancelled:
            log.info("request_skipped", request_id=request.request_id, reason="cancelled while queued")
            self._drops.append((delivery, None))
        elif time.time() > request.deadline:
            log.info("request_skipped", request_id=request.request_id, reason="expired while queued")
            message = f"request {request.request_id} expired in the queue"
            self._drops.append((delivery, ErrorInfo(message=message, error_type="Timeout", status=504)))
        elif self._has_room(request.priority):
            self._active[request.request_id] = _Taken(delivery, RequestTimer(self._metrics, request))
            self._engine.submit(request, time.monotonic())
            log.info(
                "request_admitted",
                request_id=request.request_id,
                priority=request.priority,
                running=len(self._active),
            )
        else:
            return False
        return True

    def _has_room(self, priority: int) -> bool:
        """A free slot, or a running request of a lower priority that the engine will preempt for it."""
        capacity = self._config.max_batch_size
        if len(self._active) < capacity:
            return True
        displaced = len(self._active) - capacity  # already waiting in the engine for a slot
        return sum(1 for t in self._active.values() if t.priority > priority) > displaced

    # -- events out

    async def _publish_events(self, queue: RequestQueue) -> None:
        while True:
            events = await self._steps.get()
            now = time.time()
            by_gateway: dict[str, list[TokenEvent]] = defaultdict(list)
            for event in events:
                taken = self._active.get(event.request_id)
                if taken is None:
                    continue
                by_gateway[taken.delivery.request.reply_to].append(event)
                taken.timer.event(event, now)
                if taken.cancelled:
                    TOKENS_AFTER_CANCEL.labels(self.model.name).inc(len(event.token_ids))
            await asyncio.gather(*(self._publish(topic, batch) for topic, batch in by_gateway.items()))
            for event in events:
                if event.finish_reason is not None or event.error is not None:
                    taken = self._active.pop(event.request_id, None)
                    if taken is not None:
                        queue.finished(taken.delivery)
                        log.info(
                            "request_finished",
                            request_id=event.request_id,
                            finish_reason=event.finish_reason,
                            generated_tokens=event.index + len(event.token_ids),
                        )

    async def _publish(self, topic: str, events: list[TokenEvent]) -> None:
        try:
            await self._bus.publish(topic, TokenEvents(worker_id=self._settings.worker_id, events=events))
        except (BusUnavailable, UnknownTopic) as error:
            # The gateway is gone or unreachable; its clients get their error
            # from the gateway's own deadline, so there is no one to tell here.
            log.warning("events_not_published", topic=topic, error=str(error))

    # -- control topic, heartbeats, backlog

    async def _follow_control(self, control: Listener) -> None:
        async for message in control:
            if not isinstance(message, CancelRequest):
                continue
            taken = self._active.get(message.request_id)
            if taken is not None and not taken.cancelled:
                taken.cancelled = True
                self._engine.cancel(message.request_id)
                self._metrics.cancellations.labels(self.model.name, message.reason).inc()
                log.info("request_cancel_received", request_id=message.request_id, reason=message.reason)
            elif taken is None and message.deadline > time.time():
                self._cancelled[message.request_id] = message.deadline  # skipped if it is taken later

    def _heartbeat(self, leaving: bool = False) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self._settings.worker_id,
            model=self.model,
            running=len(self._active),
            capacity=self._config.max_batch_size,
            interval_s=self._settings.heartbeat_interval_s,
            leaving=leaving,
        )

    async def _send_heartbeats(self) -> None:
        while True:
            try:
                await self._bus.publish(self._control_topic, self._heartbeat())
            except (BusUnavailable, UnknownTopic) as error:
                log.warning("heartbeat_not_published", error=str(error))
            now = time.time()  # a cancel outlives its request's deadline in no one's interest
            self._cancelled = {r: deadline for r, deadline in self._cancelled.items() if deadline > now}
            await asyncio.sleep(self._settings.heartbeat_interval_s)

    async def _measure_backlog(self) -> None:
        while True:
            await record_backlog(self._bus, self._metrics, self._settings.topic_prefix, self.model.name)
            await asyncio.sleep(_BACKLOG_INTERVAL_S)
