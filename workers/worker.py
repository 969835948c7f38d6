"""A worker: takes requests of its model from the bus, runs them, streams the tokens back.

It takes only as many requests as its engine has free slots, most urgent
first, and acknowledges each once its last event is published. Every engine
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

from bus.base import Bus, BusUnavailable, Delivery, Listener, RequestQueue, UnknownTopic
from bus.topics import control_topic, request_topics
from schemas.messages import (
    CancelRequest,
    ErrorInfo,
    FinishReason,
    ServedModel,
    TokenEvent,
    TokenEvents,
    WorkerHeartbeat,
)
from workers.engine.engine import Engine, EngineConfig
from workers.engine.model_runner import LoadedModel

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    topic_prefix: str = "tokenrelay"
    partitions: int = 8  # per request topic: up to this many workers share a priority
    heartbeat_interval_s: float = 1.0


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
        self._topics = request_topics(settings.topic_prefix, self.model.name)
        self._control_topic = control_topic(settings.topic_prefix)
        self._active: dict[str, Delivery] = {}  # request id -> where it came from
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
        group = f"{self._settings.topic_prefix}.workers.{self.model.name}"
        self._queue = await self._bus.open_request_queue(self._topics, group)
        self._engine.start()
        log.info("worker_started", worker_id=self._settings.worker_id, model=self.model.name, group=group)

    async def run(self) -> None:
        """Serve until cancelled, or until a part of the worker fails."""
        assert self._queue is not None and self._control is not None
        tasks = [
            asyncio.create_task(self._take_requests(self._queue), name="take-requests"),
            asyncio.create_task(self._publish_events(self._queue), name="publish-events"),
            asyncio.create_task(self._follow_control(self._control), name="follow-control"),
            asyncio.create_task(self._send_heartbeats(), name="heartbeats"),
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

    # -- tasks

    async def _take_requests(self, queue: RequestQueue) -> None:
        while True:
            if not self._engine.alive():
                raise RuntimeError("the engine thread died")
            free = self._config.max_batch_size - len(self._active)
            # A full engine still polls, briefly, to stay in the Kafka group.
            for delivery in await queue.take(free, timeout_s=0.1 if free else 0.02):
                await self._admit(queue, delivery)

    async def _admit(self, queue: RequestQueue, delivery: Delivery) -> None:
        request = delivery.request
        if request.request_id in self._active:  # delivered again while it runs here
            queue.finished(delivery)
            return
        if time.time() > request.deadline:
            expired = TokenEvent(
                request_id=request.request_id,
                attempt=request.attempt,
                index=0,
                finish_reason=FinishReason.STOP_SEQUENCE,
                error=ErrorInfo(
                    message=f"request {request.request_id} expired in the queue", error_type="Timeout", status=504
                ),
            )
            await self._publish(request.reply_to, [expired])
            queue.finished(delivery)
            return
        self._active[request.request_id] = delivery
        self._engine.submit(request, time.monotonic())
        log.info(
            "request_admitted", request_id=request.request_id, priority=request.priority, running=len(self._active)
        )

    async def _publish_events(self, queue: RequestQueue) -> None:
        while True:
            events = await self._steps.get()
            by_gateway: dict[str, list[TokenEvent]] = defaultdict(list)
            for event in events:
                delivery = self._active.get(event.request_id)
                if delivery is not None:
                    by_gateway[delivery.request.reply_to].append(event)
            await asyncio.gather(*(self._publish(topic, batch) for topic, batch in by_gateway.items()))
            for event in events:
                if event.finish_reason is not None or event.error is not None:
                    delivery = self._active.pop(event.request_id, None)
                    if delivery is not None:
                        queue.finished(delivery)
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

    async def _follow_control(self, control: Listener) -> None:
        async for message in control:
            if isinstance(message, CancelRequest) and message.request_id in self._active:
                self._engine.cancel(message.request_id)
                log.info("request_cancel_received", request_id=message.request_id, reason=message.reason)

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
            await asyncio.sleep(self._settings.heartbeat_interval_s)
