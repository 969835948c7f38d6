"""A worker: takes requests of its model from the bus, runs them, streams the tokens back.

Requests reach it two ways: routed to its own inbox by a gateway's router
(gateway/dispatch/router.py), which reads its load reports (load_report.py), or from
the request topics that all workers of the model share, where a gateway
puts what no worker has room for. It takes only what its engine can start
now, most urgent first: a free slot,
or the slot of a running request of a lower priority, which the engine then
preempts. Expired, cancelled and superseded requests (an older attempt of a
request that failed over) are dropped when they are taken; each request is
acknowledged once its last event is published. Every engine step's events
leave as one message per gateway. Heartbeats on the control topic tell
gateways that it lives, what it serves and which requests it runs (a gateway
fails over the ones a worker stops listing); cancellations and the gateways'
heartbeats arrive there too: the requests of a gateway that left or went
silent are cancelled, or skipped when taken. Draining (SIGTERM) stops the
taking, leaves the group and hands back what waits; what runs either ends
here or is handed over when the drain's time is up. The LoRA adapters loaded
and unloaded at run time come on the adapters topic, read from its
beginning: those of its model are checked (read and validated on the event
loop, never touching the engine's host cache, which is the engine thread's),
then announced in its heartbeats beside those it started with; one unloaded
is forgotten by the engine, through its inbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

import structlog
from prometheus_client import Counter, Gauge

from bus.base import Bus, BusUnavailable, Delivery, Listener, RequestQueue, offer
from bus.peers import PeerClock, send_own_heartbeat
from bus.prefixes import CHUNK_BYTES, prefix_hashes, prompt_bytes
from bus.topics import adapters_topic, control_topic, inbox_topic, request_topics, routing_topic, worker_group
from schemas.adapters import AdapterError, LoraSupport, check_fits, read_adapter
from schemas.messages import (
    STREAM_ERRORS,
    TIMEOUT,
    AdapterState,
    CancelRequest,
    ErrorInfo,
    FinishReason,
    GatewayHeartbeat,
    GenerationRequest,
    ServedModel,
    TokenEvent,
    TokenEvents,
    WorkerHeartbeat,
)
from telemetry.metrics import RequestTimer, metrics_of, record_backlog
from workers.engine.adapters import AdapterCounts
from workers.engine.admission import unstarted_end
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, Model
from workers.engine.request import EngineRequest, PromptPrefixes
from workers.load_report import LoadReporter
from workers.settings import WorkerSettings

log = structlog.get_logger(__name__)

TOKENS_AFTER_CANCEL = Counter(
    "tokenrelay_worker_tokens_after_cancel",
    "Tokens generated for requests after their cancellation reached the worker (at most one step's worth).",
    ["model"],
)
TENSOR_PARALLEL_SIZE = Gauge(
    "tokenrelay_worker_tensor_parallel_size", "Ranks (devices) the worker's model is split across.", ["model"]
)
ADAPTER_REQUESTS = Counter(
    "tokenrelay_worker_adapter_requests_total", "Requests started under each LoRA adapter.", ["model", "adapter"]
)
ADAPTER_TOKENS = Counter(
    "tokenrelay_worker_adapter_tokens_total", "Tokens generated under each LoRA adapter.", ["model", "adapter"]
)
ADAPTER_LOADS = Counter(
    "tokenrelay_worker_adapter_loads_total", "LoRA adapters put into a device slot.", ["model", "adapter"]
)
ADAPTER_EVICTIONS = Counter(
    "tokenrelay_worker_adapter_evictions_total", "LoRA adapters taken out of a device slot for another.", ["model"]
)
SPECULATIVE = {  # engine.stats() key -> its counter (workers/engine/speculation.py)
    "speculative_proposed": Counter(
        "tokenrelay_worker_speculative_proposed_tokens", "Tokens proposed for verification within a step.", ["model"]
    ),
    "speculative_accepted": Counter(
        "tokenrelay_worker_speculative_accepted_tokens",
        "Proposed tokens the model's own draws confirmed (acceptance rate: over proposed).",
        ["model"],
    ),
    "speculative_verifications": Counter(
        "tokenrelay_worker_speculative_verifications",
        "A sequence's proposals verified in a step (mean accepted length: accepted tokens over these).",
        ["model"],
    ),
}
_BACKLOG_INTERVAL_S = 5.0
# A gateway silent this long (three heartbeats) is gone; its requests are cancelled.
_GATEWAY_SILENCE_S = 3.0
_FORGET_GONE_GATEWAY_S = 3600.0  # the longest timeout a request may have
# Own heartbeats published this long without one coming back: rebuild the control consumer.
_CONTROL_STUCK_S = 10.0
_NOTHING_TO_ACKNOWLEDGE = "inbox"  # a Delivery's source: read from the inbox, or acknowledged already


@dataclass
class _Taken:
    """A request this worker runs."""

    delivery: Delivery
    timer: RequestTimer
    cancelled_at: float | None = None  # time.monotonic() when its cancellation reached this worker

    @property
    def priority(self) -> int:
        return self.delivery.request.priority

    @property
    def attempt(self) -> int:
        return self.delivery.request.attempt


class Worker:
    def __init__(
        self,
        bus: Bus,
        loaded: Model,
        config: EngineConfig,
        served_names: list[str],
        settings: WorkerSettings,
        adapters: dict[str, str] | None = None,
    ) -> None:
        """`adapters`: the LoRA adapters served from the start, name -> directory (each read and checked here:
        schemas.adapters.AdapterError if one cannot be served)."""
        self._bus = bus
        self._settings = settings
        self._engine = Engine(loaded, config, self._on_engine_step, on_cache=self._on_cache_change)
        self._config = config = self._engine.config  # with the device's defaults
        self._adapter_counts_seen = AdapterCounts()  # of the engine's, those counted in /metrics
        self._speculation_seen = dict.fromkeys(SPECULATIVE, 0)  # of the engine's stats, those counted in /metrics
        self._static_adapters = dict(adapters or {})  # --lora: served whatever the adapters topic says
        self._runtime_adapters: dict[str, str] = {}  # loaded at run time (the adapters topic), name -> directory
        self.model = ServedModel(
            name=served_names[0],
            aliases=served_names,
            max_seq_len=config.max_seq_len,
            max_input_len=self._engine.max_input_len,
            max_iter_times=config.max_iter_times,
            vocab_size=loaded.vocab_size,
            image_pixels=self._engine.image_pixels,
            **self._served_adapters(adapters or {}),
        )
        self._metrics = metrics_of("worker")
        self._metrics.count_from_zero(self.model.name, STREAM_ERRORS)
        TOKENS_AFTER_CANCEL.labels(self.model.name)  # exported at 0 until the first
        TENSOR_PARALLEL_SIZE.labels(self.model.name).set(loaded.tensor_parallel_size)
        self._topics = request_topics(settings.topic_prefix, self.model.name)
        self._group = worker_group(settings.topic_prefix, self.model.name)
        self._control_topic = control_topic(settings.topic_prefix)
        self._inbox_topic = inbox_topic(settings.topic_prefix, settings.worker_id)
        self._routing_topic = routing_topic(settings.topic_prefix)
        self._adapters_topic = adapters_topic(settings.topic_prefix)
        self._inbox_waiting: list[Delivery] = []  # read from the inbox, not started yet
        self._inbox_reads: defaultdict[str, int] = defaultdict(int)  # per gateway's reply topic, since start
        # Only the stuck-consumer check of the inbox listener: no peers there.
        self._inbox_echo = PeerClock(settings.heartbeat_interval_s, 0.0, _CONTROL_STUCK_S, 0.0)
        self._load = LoadReporter(
            bus,
            self._routing_topic,
            {
                "worker_id": settings.worker_id,
                "model": self.model.name,
                "inbox": self._inbox_topic,
                "tensor_parallel_size": loaded.tensor_parallel_size,
            },
            settings.heartbeat_interval_s,
            self._current_load,
        )
        self._active: dict[str, _Taken] = {}  # request id -> the request running here
        # Request id -> its latest cancel, kept until the request's deadline: a
        # request (or attempt) cancelled before it is taken is skipped then.
        self._cancelled: dict[str, CancelRequest] = {}
        # The gateways, by reply topic; their silence counts only while the control topic works.
        self._gateways = PeerClock(
            settings.heartbeat_interval_s, _GATEWAY_SILENCE_S, _CONTROL_STUCK_S, _FORGET_GONE_GATEWAY_S
        )
        self._drops: list[tuple[Delivery, TokenEvent | None]] = []  # taken only to be dropped, and its last event
        self._steps: asyncio.Queue[tuple[float, list[TokenEvent]]] = asyncio.Queue()  # (computed at, events)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: RequestQueue | None = None
        self._control: Listener | None = None
        self._inbox: Listener | None = None
        self._adapter_states: Listener | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._draining = False
        self._engine_stuck = False  # its step outlasted engine_stuck_s: stop() does not wait for it
        # Request id -> attempt, taken and given up while draining: heartbeats name them so gateways fail them over.
        self._handed_back: dict[str, int] = {}

    async def start(self) -> None:
        """Create the topics, open the inbox, join the request group, start the engine."""
        structlog.contextvars.bind_contextvars(worker_id=self._settings.worker_id)  # this task's lines, and its tasks'
        self._loop = asyncio.get_running_loop()
        partitions = {topic: self._settings.partitions for topic in self._topics}
        singles = dict.fromkeys((self._control_topic, self._inbox_topic, self._routing_topic), 1)
        await self._bus.create_topics({**partitions, **singles})
        await self._bus.create_topics({self._adapters_topic: 1}, compacted=True)
        self._control = await self._bus.listen(self._control_topic)
        self._adapter_states = await self._bus.listen(self._adapters_topic, from_start=True)
        self._inbox = await self._bus.listen(self._inbox_topic)  # before any report names it
        self._queue = await self._bus.open_request_queue(self._topics, self._group, self._config.aging_s)
        self._engine.start()
        log.info("worker_started", worker_id=self._settings.worker_id, model=self.model.name, group=self._group)

    async def run(self) -> None:
        """Serve until cancelled, or until a part of the worker fails."""
        structlog.contextvars.bind_contextvars(worker_id=self._settings.worker_id)  # this task's lines, and its tasks'
        assert self._queue is not None and self._control is not None and self._inbox is not None
        assert self._adapter_states is not None
        self._tasks = {
            name: asyncio.create_task(coroutine, name=name)
            for name, coroutine in (
                ("take-requests", self._take_requests(self._queue)),
                ("read-inbox", self._read_inbox(self._inbox)),
                ("load-reports", self._load.run()),
                ("publish-events", self._publish_events(self._queue)),
                ("follow-control", self._follow_control(self._control)),
                ("follow-adapters", self._follow_adapters(self._adapter_states)),
                ("heartbeats", self._send_heartbeats()),
                ("measure-backlog", self._measure_backlog(self._queue)),
            )
        }
        tasks = list(self._tasks.values())
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises what ended it
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self, timeout_s: float) -> None:
        """Take nothing more and let what runs end, for at most `timeout_s`; stop() then hands over the rest.

        The routers hear at once that it drains; it leaves the request group
        at once, so that what waits in the shared topics goes to the other
        workers; what waits in its inbox is handed back to the gateways.
        """
        assert self._queue is not None
        self._draining = True
        log.info("worker_draining", worker_id=self._settings.worker_id, running=len(self._active))
        try:  # a second signal may cut it short anywhere: the drained line still says what it hands over
            for delivery in self._inbox_waiting:
                self._hand_back(delivery)
            self._inbox_waiting.clear()
            self._load.changed()
            for name in ("take-requests", "measure-backlog"):  # the two that use the queue, besides event publishing
                if (task := self._tasks.get(name)) is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            for taken in self._active.values():
                # Acknowledged now, as if it ended: no other worker is to take it from the topic too (its gateway
                # fails it over if it does not end here); nothing is left to acknowledge when it ends.
                self._finished(taken.delivery)
                taken.delivery = dataclasses.replace(taken.delivery, source=_NOTHING_TO_ACKNOWLEDGE)
            await self._queue.close()  # leaves the group
            await self._bus.publish_or_log(self._control_topic, self._heartbeat(), "heartbeat_not_published")
            deadline = time.monotonic() + timeout_s
            while self._active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            log.info("worker_drained", worker_id=self._settings.worker_id, handed_over=len(self._active))

    def _hand_back(self, delivery: Delivery) -> None:
        self._handed_back[delivery.request.request_id] = delivery.request.attempt
        self._finished(delivery)
        log.info("request_handed_back", **delivery.request.log_ids(), attempt=delivery.request.attempt)

    async def stop(self) -> None:
        await self._bus.publish_or_log(self._control_topic, self._heartbeat(leaving=True), "leaving_not_announced")
        self._engine.stop(wait_s=0.0 if self._engine_stuck else 30.0)  # its thread is a daemon: it ends with us
        if self._queue is not None and not self._draining:  # a drain has closed it
            await self._queue.close()
        if self._control is not None:
            await self._control.close()
        if self._inbox is not None:
            await self._inbox.close()
        if self._adapter_states is not None:
            await self._adapter_states.close()
        try:  # what it still held is failed over by the gateways, which heard it leave
            await self._bus.delete_topics([self._inbox_topic])
        except Exception as error:  # the broker may be gone already; the topic is then left behind
            log.warning("inbox_not_deleted", topic=self._inbox_topic, error=str(error))

    # -- engine thread -> event loop

    def _on_engine_step(self, events: list[TokenEvent]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._steps.put_nowait, (time.monotonic(), events))

    def _on_cache_change(self, added: list[int], removed: list[int]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._load.cache_changed, added, removed)

    # -- taking requests

    async def _take_requests(self, queue: RequestQueue) -> None:
        while True:  # until drain() cancels it
            if not self._engine.alive():
                raise RuntimeError("the engine thread died")
            offer(self._inbox_waiting, self._take_on, self._config.aging_s)  # routed here: first
            await queue.take(self._take_on, timeout_s=0.02)
            await self._settle_drops()

    async def _fill_freed_slots(self, queue: RequestQueue) -> None:
        """Requests finished: start what waits here now, rather than on the take loop's next turn."""
        if self._draining:
            return
        offer(self._inbox_waiting, self._take_on, self._config.aging_s)
        queue.offer_waiting(self._take_on)
        await self._settle_drops()

    async def _read_inbox(self, inbox: Listener) -> None:
        """Requests routed here; started at once when there is room (else by the take loop, in turn)."""
        async for message in inbox:
            if isinstance(message, WorkerHeartbeat):  # its own, sent to check that the inbox still delivers
                self._inbox_echo.own_heard(time.monotonic())
            elif isinstance(message, GenerationRequest):
                self._inbox_reads[message.reply_to] += 1
                if self._draining:  # routed here before its gateway heard
                    self._hand_back(Delivery(message, _NOTHING_TO_ACKNOWLEDGE))
                    continue
                self._inbox_waiting.append(Delivery(message, _NOTHING_TO_ACKNOWLEDGE))
                offer(self._inbox_waiting, self._take_on, self._config.aging_s)
                self._load.changed()
                await self._settle_drops()

    async def _settle_drops(self) -> None:
        drops, self._drops = self._drops, []
        for delivery, last in drops:
            if last is not None:
                await self._publish(delivery.request.reply_to, [last])
            self._finished(delivery)

    def _finished(self, delivery: Delivery) -> None:
        if delivery.source is not _NOTHING_TO_ACKNOWLEDGE:
            assert self._queue is not None
            self._queue.finished(delivery)

    def _take_on(self, delivery: Delivery) -> bool:
        """Whether to take a request now (`RequestQueue.take`'s accept): to start it, or to drop it."""
        request = delivery.request
        running = self._active.get(request.request_id)
        cancel = self._cancelled.get(request.request_id)
        if running is not None and running.attempt >= request.attempt:  # delivered again while it runs here
            self._drops.append((delivery, None))
        elif running is not None:  # a failover of the one running here: that one is stale; start this once it ends
            self._cancel(running, "superseded")
            return False
        elif cancel is not None and cancel.covers(request.attempt):
            log.info("request_skipped", **request.log_ids(), attempt=request.attempt, reason=cancel.reason)
            # Stopped before it came (a stop travels on the control topic, the request on another): it ends as a
            # running one would, with its last event, which its gateway waits for. A failover's fence of an old
            # attempt is not answered: nobody waits for that attempt.
            fenced = cancel.attempts_before is not None
            self._drops.append((delivery, None if fenced else unstarted_end(request, FinishReason.STOP_SEQUENCE)))
        elif self._gateways.gone(request.reply_to, time.monotonic()):
            log.info("request_skipped", **request.log_ids(), reason="its gateway is gone")
            self._drops.append((delivery, None))
        elif time.time() > request.deadline:
            log.info("request_skipped", **request.log_ids(), reason="expired while queued")
            error = ErrorInfo(
                message=f"request {request.request_id} expired in the queue", error_type=TIMEOUT, status=504
            )
            self._drops.append((delivery, unstarted_end(request, FinishReason.STOP_SEQUENCE, error)))
        elif self._has_room(request.priority):
            self._gateways.expect(request.reply_to, time.monotonic())
            self._active[request.request_id] = _Taken(delivery, RequestTimer(self._metrics, request))
            self._engine.submit(engine_request(request), time.monotonic())
            if request.adapter is not None:
                ADAPTER_REQUESTS.labels(self.model.name, request.adapter).inc()
            self._load.changed()
            log.info(
                "request_admitted",
                worker_id=self._settings.worker_id,
                **request.log_ids(),
                priority=request.priority,
                attempt=request.attempt,
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
            # A step's events may wait here while earlier ones are published: when they were computed
            # tells whether the engine made them after a cancellation came.
            computed_at, events = await self._steps.get()
            now = time.time()
            by_gateway: dict[str, list[TokenEvent]] = defaultdict(list)
            for event in events:
                taken = self._active.get(event.request_id)
                if taken is None:
                    continue
                by_gateway[taken.delivery.request.reply_to].append(event)
                taken.timer.event(event, now)
                if taken.delivery.request.adapter is not None and event.token_ids:
                    ADAPTER_TOKENS.labels(self.model.name, taken.delivery.request.adapter).inc(len(event.token_ids))
                if taken.cancelled_at is not None and computed_at > taken.cancelled_at:
                    TOKENS_AFTER_CANCEL.labels(self.model.name).inc(len(event.token_ids))
            self._count_speculation()  # before the events go: a client that has them finds them counted
            await asyncio.gather(*(self._publish(topic, batch) for topic, batch in by_gateway.items()))
            finished = False
            for event in events:
                if event.finish_reason is not None or event.error is not None:
                    taken = self._active.pop(event.request_id, None)
                    if taken is not None:
                        self._finished(taken.delivery)
                        self._load.changed()
                        finished = True
                        log.info(
                            "request_finished",
                            worker_id=self._settings.worker_id,
                            **taken.delivery.request.log_ids(),
                            finish_reason=event.finish_reason,
                            generated_tokens=event.index + len(event.token_ids),
                        )
            if finished:
                await self._fill_freed_slots(queue)

    async def _publish(self, topic: str, events: list[TokenEvent]) -> None:
        # If the gateway is gone or unreachable, its clients get their error from
        # the gateway's own deadline: there is no one to tell here.
        batch = TokenEvents(worker_id=self._settings.worker_id, events=events)
        await self._bus.publish_or_log(topic, batch, "events_not_published")

    # -- control topic, heartbeats, backlog

    async def _follow_control(self, control: Listener) -> None:
        async for message in control:
            now = time.monotonic()
            if isinstance(message, GatewayHeartbeat):
                if message.leaving:
                    self._gateways.left(message.reply_to, now)
                else:
                    self._gateways.heard(message.reply_to, now)
            elif isinstance(message, WorkerHeartbeat) and message.worker_id == self._settings.worker_id:
                self._gateways.own_heard(now)
            elif isinstance(message, CancelRequest):
                self._follow_cancel(message)

    async def _follow_adapters(self, states: Listener) -> None:
        """The adapters loaded and unloaded at run time: those of its model, served or dropped."""
        async for state in states:
            if isinstance(state, AdapterState) and state.model == self.model.name:
                await self._adapter_changed(state)

    async def _adapter_changed(self, state: AdapterState) -> None:
        served = self._engine.adapters
        if served is None or state.name in self._static_adapters:
            log.info("adapter_ignored", adapter=state.name, reason="no --max-loras" if served is None else "--lora")
            return
        if not state.loaded:
            if self._runtime_adapters.pop(state.name, None) is not None:
                self._engine.forget_adapter(state.name)
                log.info("adapter_removed", adapter=state.name)
        else:
            try:  # read-only, off the loop: the engine thread reads it into its host cache on the first request
                await asyncio.to_thread(_check_adapter, state.path, served.support, self._config.max_lora_rank)
            except AdapterError as error:
                log.warning("adapter_refused", adapter=state.name, path=state.path, error=str(error))
                return
            if self._runtime_adapters.get(state.name) not in (None, state.path):  # loaded again from elsewhere
                self._engine.forget_adapter(state.name)
            self._runtime_adapters[state.name] = state.path
            log.info("adapter_added", adapter=state.name, path=state.path)
        self.model = self.model.model_copy(update={"adapters": {**self._static_adapters, **self._runtime_adapters}})

    def _follow_cancel(self, cancel: CancelRequest) -> None:
        taken = self._active.get(cancel.request_id)
        if taken is not None and cancel.covers(taken.attempt):
            self._cancel(taken, cancel.reason)
        known = self._cancelled.get(cancel.request_id)
        if (known is None or cancel.reach > known.reach) and cancel.deadline > time.time():
            self._cancelled[cancel.request_id] = cancel  # a later delivery of what it covers is skipped

    def _cancel(self, taken: _Taken, reason: str) -> None:
        if taken.cancelled_at is not None:
            return
        taken.cancelled_at = time.monotonic()
        request = taken.delivery.request
        self._engine.cancel(request.request_id)
        self._metrics.cancelled(self.model.name, reason)
        log.info("request_cancel_received", **request.log_ids(), reason=reason)

    def _drop_orphans(self) -> None:
        """Stop generating for gateways that left or went silent: nobody reads those tokens."""
        now = time.monotonic()
        for taken in list(self._active.values()):
            if self._gateways.gone(taken.delivery.request.reply_to, now):
                self._cancel(taken, "gateway gone")
        # A gone gateway is remembered as long as its requests may still wait in a topic, to skip them.
        self._gateways.forget_old(now)

    def _current_load(self) -> dict:
        by_priority = [0] * 5
        for taken in self._active.values():
            by_priority[taken.priority - 1] += 1
        return {
            "capacity": self._config.max_batch_size,
            "running": len(self._active),
            "waiting": len(self._inbox_waiting) + (self._queue.waiting() if self._queue else 0),
            "running_by_priority": by_priority,
            "kv_blocks": self._engine.kv_blocks,
            "free_kv_blocks": self._engine.free_kv_blocks,
            "block_size": self._config.block_size,
            "seconds_per_prompt_token": self._engine.seconds_per_prompt_token,
            **self._engine.prompt_stats(),
            "inbox_reads": dict(self._inbox_reads),
            "draining": self._draining,
            **self._adapter_slots(),
            "adapter_loads": self._engine.adapters.counts.loads if self._engine.adapters is not None else 0,
        }

    def _count_speculation(self) -> None:
        stats, seen = self._engine.stats(), self._speculation_seen
        for key, counter in SPECULATIVE.items():
            if stats[key] > seen[key]:
                counter.labels(self.model.name).inc(stats[key] - seen[key])
                seen[key] = stats[key]

    def _adapter_slots(self) -> dict:
        """What the load reports say of the engine's device slots for adapters; its loads and evictions since
        the last call, counted."""
        adapters = self._engine.adapters
        if adapters is None:
            return {}
        counts, seen = adapters.counts, self._adapter_counts_seen
        for name, loads in list(counts.by_name.items()):  # a copy in one go: the engine thread adds to it
            ADAPTER_LOADS.labels(self.model.name, name).inc(loads - seen.by_name.get(name, 0))
            seen.by_name[name] = loads
        evictions = counts.evictions
        ADAPTER_EVICTIONS.labels(self.model.name).inc(evictions - seen.evictions)
        seen.evictions = evictions
        resident, idle = adapters.resident()
        return {"adapters": resident, "idle_adapters": idle, "adapter_slots": adapters.slots}

    def _served_adapters(self, adapters: dict[str, str]) -> dict:
        """What the heartbeats say of LoRA adapters: what the model takes of them, and those served."""
        served = self._engine.adapters
        if served is None:
            if adapters:
                raise AdapterError("--lora: this model's workers serve no adapters (--max-loras 0)")
            return {}
        for name, path in adapters.items():
            served.check(name, path)
        return {"lora": served.support, "adapters": adapters}

    def _heartbeat(self, leaving: bool = False) -> WorkerHeartbeat:
        # What waits in its inbox is listed too: a gateway fails over what a live worker does not list.
        held = {d.request.request_id: d.request.attempt for d in self._inbox_waiting}
        return WorkerHeartbeat(
            worker_id=self._settings.worker_id,
            model=self.model,
            running=len(self._active),
            requests=held | {request_id: taken.attempt for request_id, taken in self._active.items()},
            capacity=self._config.max_batch_size,
            interval_s=self._settings.heartbeat_interval_s,
            leaving=leaving,
            handed_back=self._handed_back,
        )

    async def _send_heartbeats(self) -> None:
        """On the control topic, and on the inbox: each listener must hear its own worker's heartbeats."""
        assert self._control is not None and self._inbox is not None
        watched = [
            (self._control_topic, self._control, self._gateways),
            (self._inbox_topic, self._inbox, self._inbox_echo),
        ]
        while True:
            # A step that never ends would leave the worker heartbeating, its requests never failed over: it
            # stops instead (exit 1; an orchestrator restarts it), and the gateways fail its requests over.
            if self._settings.engine_stuck_s and (busy := self._engine.busy_s()) > self._settings.engine_stuck_s:
                log.error("engine_stuck", worker_id=self._settings.worker_id, step_s=busy)
                self._engine_stuck = True
                raise RuntimeError(f"the engine's step has run for {busy:.0f} s")
            for topic, listener, echo in watched:
                await send_own_heartbeat(self._bus, topic, self._heartbeat(), listener, echo)
            now = time.time()  # a cancel outlives its request's deadline in no one's interest
            self._cancelled = {r: c for r, c in self._cancelled.items() if c.deadline > now}
            self._drop_orphans()
            await asyncio.sleep(self._settings.heartbeat_interval_s)

    async def _measure_backlog(self, queue: RequestQueue) -> None:
        """The backlog gauge, and the request queue's liveness check (it may need the broker too)."""
        while True:
            await record_backlog(self._bus, self._metrics, self._settings.topic_prefix, self.model.name)
            try:
                await queue.revive_if_stuck()
            except BusUnavailable as error:
                log.debug("liveness_not_checked", error=str(error))
            await asyncio.sleep(_BACKLOG_INTERVAL_S)


def _check_adapter(path: str, support: LoraSupport | None, max_rank: int) -> None:
    """AdapterError unless the adapter in `path` fits the model (`support`; None: only its own checks)."""
    spec = read_adapter(path, max_rank)
    if support is not None:
        check_fits(spec, support)


def engine_request(request: GenerationRequest) -> EngineRequest:
    """The engine's request for one from the bus, its prompt's prefixes named as routers name them."""
    data = prompt_bytes(request)
    return EngineRequest(
        request_id=request.request_id,
        sampling=request.sampling,
        deadline=request.deadline,
        model=request.model,
        task=request.task,
        attempt=request.attempt,
        priority=request.priority,
        tenant=request.tenant,
        tenant_weight=request.tenant_weight,
        preempt_for_share=request.preempt_for_share,
        prompt_text=request.prompt_text,
        prompt_token_ids=request.prompt_token_ids,
        chat_messages=request.chat_messages,
        prompt_parts=request.prompt_parts,
        images=tuple(request.images),
        tools=request.tools,
        truncate=request.truncate,
        tokenization=request.tokenization,
        tokens_before=request.tokens_before,
        generated_token_ids=tuple(request.generated_token_ids),
        prefixes=PromptPrefixes(tuple(prefix_hashes(request, data)), len(data), CHUNK_BYTES),
        adapter=request.adapter,
        adapter_path=request.adapter_path,
        evict_adapters_first=tuple(request.evict_adapters_first),
    )
