"""The gateway's side of the bus: publish requests, route replies, know the workers.

One instance per gateway process. It owns the gateway's reply topic (created
at start, deleted at a clean stop), listens to the control topic for the
workers' heartbeats and to the routing topic for their load reports, which
its router (dispatch/router.py) reads to pick each request's worker, and to the
adapters topic from its beginning for the LoRA adapters loaded at run time
(routes/lora.py publishes them there, through `change_adapter`). The HTTP routes
call `resolve`, `submit` and `stop_requests`. A stopInfer for a request that
another gateway took is asked of every gateway on the control topic.
Its heartbeats go to the control topic (workers drop the requests of a gateway
that stops sending them) and to its own reply topic: a listener that does not
hear its own gateway's heartbeats for a while is stuck, and is rebuilt.
Draining (SIGTERM) refuses new requests with 503 while those in flight end.
With a tenants file, it admits each tenant's requests within the tenant's
allowance and limits (tenancy/admission.py); every request ends with one usage record
on the usage topic (tenancy/usage.py).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import structlog

from bus.base import Bus, BusUnavailable, Listener, UnknownTopic
from bus.peers import PeerClock, send_own_heartbeat
from bus.topics import adapters_topic, control_topic, reply_topic, routing_topic, usage_topic
from gateway.access_log import current_request_id
from gateway.dispatch import failover
from gateway.dispatch.directory import WorkerDirectory
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.failover import CHECK_EVERY_S, Failover
from gateway.dispatch.inflight import InFlight, InFlightRegistry
from gateway.dispatch.router import Router
from gateway.errors import PAYLOAD_TOO_LARGE, ApiError, not_found, unavailable
from gateway.settings import GatewaySettings
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.api_keys import current_key_id
from gateway.tenancy.tenants import Tenants
from gateway.tenancy.usage import UsageMeter
from schemas.messages import (
    STREAM_ERRORS,
    AdapterState,
    CancelRequest,
    ChatMessage,
    ContentPart,
    GatewayHeartbeat,
    GenerationRequest,
    SamplingParams,
    ServedModel,
    StopAnswer,
    StopClientRequest,
    Task,
    TokenEvent,
    TokenEvents,
    Tokenization,
    WorkerHeartbeat,
    WorkerLoad,
    encode,
)
from telemetry.metrics import metrics_of, record_backlog

log = structlog.get_logger(__name__)

TOO_MANY_REQUESTS = "Too Many Requests"
SERVICE_UNAVAILABLE = "Service Unavailable"
FAILURES = (*STREAM_ERRORS, SERVICE_UNAVAILABLE, TOO_MANY_REQUESTS)  # what a request here may fail with
CLIENT_GONE = "client gone"
RETRY_AFTER_S = 1  # in-flight requests end every few tens of milliseconds under load
BACKLOG_INTERVAL_S = 5.0
HEARTBEAT_INTERVAL_S = 1.0
LISTENER_STUCK_S = 10.0  # this many seconds of own heartbeats taken by the broker, none heard: rebuild

# Replay this much of the control topic at start, so that a new gateway knows
# the running workers at once instead of after their next heartbeat.
CONTROL_REPLAY_S = 10.0
# How long a stopInfer waits for another gateway to say it stopped the request, before answering 404.
STOP_ANSWER_TIMEOUT_S = 1.0


class GatewayService:
    def __init__(self, bus: Bus, settings: GatewaySettings) -> None:
        self._bus = bus
        self._settings = settings
        self.gateway_id = settings.gateway_id or uuid.uuid4().hex[:12]
        self._reply_topic = reply_topic(settings.topic_prefix, self.gateway_id)
        self._control_topic = control_topic(settings.topic_prefix)
        self._routing_topic = routing_topic(settings.topic_prefix)
        self._adapters_topic = adapters_topic(settings.topic_prefix)
        self._metrics = metrics_of("gateway")
        self.inflight = InFlightRegistry()
        self.router = Router(self._reply_topic)
        self._dispatcher = Dispatcher(bus, self.router if settings.route else None, settings.topic_prefix)
        self._failover = Failover(
            bus, self.inflight, self._control_topic, self._dispatcher, HEARTBEAT_INTERVAL_S, LISTENER_STUCK_S
        )
        self.directory = WorkerDirectory(self._count_from_zero, self._failover.workers.counted_to)
        self._stop_answers: dict[str, asyncio.Future[int]] = {}  # question id -> requests stopped elsewhere
        # Only the stuck-consumer check of the reply listener: no peers there, so no silence or forgetting.
        self._reply_echo = PeerClock(HEARTBEAT_INTERVAL_S, 0.0, LISTENER_STUCK_S, 0.0)
        self._listeners: list[Listener] = []
        self._tasks: list[asyncio.Task] = []
        self._publishing: set[asyncio.Task] = set()  # cancellations and usage records being published
        self.draining = False
        self._tenancy = (
            Tenancy(bus, settings.tenants_file, settings.topic_prefix, self.gateway_id)
            if settings.tenants_file
            else None
        )
        self._usage = UsageMeter(bus, usage_topic(settings.topic_prefix), self.gateway_id)

    def _count_from_zero(self, model: str) -> None:
        """A model announced for the first time: its failures and failovers are exported at 0 until they happen."""
        self._metrics.count_from_zero(model, FAILURES)
        failover.count_from_zero(model)

    async def start(self) -> None:
        await self._bus.create_topics({self._reply_topic: 1, self._control_topic: 1, self._routing_topic: 1})
        await self._bus.create_topics({self._adapters_topic: 1, self._usage.topic: 1}, compacted=True)
        replies = await self._bus.listen(self._reply_topic)
        control = await self._bus.listen(self._control_topic, replay_s=CONTROL_REPLAY_S)
        routing = await self._bus.listen(self._routing_topic, replay_s=CONTROL_REPLAY_S)
        adapters = await self._bus.listen(self._adapters_topic, from_start=True)
        self._listeners = [replies, control, routing, adapters]
        if self._tenancy is not None:
            tenants_use, tasks = await self._tenancy.start()
            self._listeners.append(tenants_use)
            self._tasks += tasks
        self._tasks += [
            asyncio.create_task(self._watch_adapters(adapters), name="watch-adapters"),
            asyncio.create_task(self._route_replies(replies), name="route-replies"),
            asyncio.create_task(self._watch_control(control), name="watch-control"),
            asyncio.create_task(self._watch_routing(routing), name="watch-routing"),
            asyncio.create_task(self._dispatcher.run(), name="dispatch-held"),
            asyncio.create_task(self._measure_backlogs(), name="measure-backlogs"),
            asyncio.create_task(self._send_heartbeats(), name="heartbeats"),
            asyncio.create_task(self._check_failovers(), name="check-failovers"),
            asyncio.create_task(self._usage.run(), name="resend-usage"),
        ]
        log.info("gateway_started", gateway_id=self.gateway_id, reply_topic=self._reply_topic)

    async def stop(self) -> None:
        if self._tenancy is not None:
            self._tenancy.stop()
        await asyncio.gather(*self._publishing, return_exceptions=True)
        await self._usage.resend()
        await self._bus.publish_or_log(self._control_topic, self._heartbeat(leaving=True), "leaving_not_announced")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for listener in self._listeners:
            await listener.close()
        try:
            await self._bus.delete_topics([self._reply_topic])
        except Exception as error:  # the broker may be gone already; the topic is then left behind
            log.warning("reply_topic_not_deleted", topic=self._reply_topic, error=str(error))

    def start_draining(self) -> None:
        """Refuse new requests (503), so that clients and load balancers go to another gateway."""
        self.draining = True
        log.info("gateway_draining", gateway_id=self.gateway_id, in_flight=len(self.inflight))

    async def drained(self, timeout_s: float) -> None:
        """Until every request in flight has ended, or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        try:
            while len(self.inflight) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:  # also when a second signal cuts it short
            log.info("gateway_drained", gateway_id=self.gateway_id, cut_short=len(self.inflight))

    async def _route_replies(self, replies: Listener) -> None:
        async for message in replies:
            if isinstance(message, TokenEvents):
                prefilled = self._failover.on_events(message)
                if self._settings.route:  # else its prompts' hashes are never computed
                    for inflight in prefilled:
                        self.router.holds(message.worker_id, inflight.prefix_hashes)
            elif isinstance(message, GatewayHeartbeat) and message.gateway_id == self.gateway_id:
                self._reply_echo.own_heard(time.monotonic())
            elif isinstance(message, StopAnswer):
                answer = self._stop_answers.get(message.question_id)
                if answer is not None and not answer.done():
                    answer.set_result(message.stopped)

    async def _watch_control(self, control: Listener) -> None:
        workers = self._failover.workers
        async for message in control:
            now = time.monotonic()
            if isinstance(message, WorkerHeartbeat):
                self.directory.observe(message)
                if message.leaving:
                    workers.left(message.worker_id, now)
                    self.router.forget(message.worker_id)
                else:
                    workers.heard(message.worker_id, now)
                    self._failover.on_heartbeat(message)
            elif isinstance(message, GatewayHeartbeat) and message.gateway_id == self.gateway_id:
                workers.own_heard(now)
            elif isinstance(message, StopClientRequest) and message.reply_to != self._reply_topic:
                await self._stop_for_another(message)

    async def _watch_routing(self, routing: Listener) -> None:
        async for message in routing:
            if isinstance(message, WorkerLoad):
                self.router.observe(message)
                self._dispatcher.room_may_have_changed()

    async def _watch_adapters(self, adapters: Listener) -> None:
        async for message in adapters:
            if isinstance(message, AdapterState):
                self.directory.adapter_changed(message)

    @property
    def tenants(self) -> Tenants | None:
        """The tenants of --tenants-file, for the API keys' middleware; None without one."""
        return self._tenancy.tenants if self._tenancy is not None else None

    def rate_limit_headers(self, tenant: str) -> dict[str, str]:
        """The x-ratelimit-* headers of an answer to a request of the tenant."""
        return self._tenancy.rate_limit_headers(tenant) if self._tenancy is not None else {}

    async def change_adapter(self, state: AdapterState) -> None:
        """Load or unload a LoRA adapter for the fleet: on the adapters topic, and in this gateway's directory at
        once (the next request sees it, before the topic brings it back); 503 if the bus does not take it."""
        try:
            await self._bus.publish(self._adapters_topic, state, key=state.key)
        except (BusUnavailable, UnknownTopic) as error:
            raise unavailable(f"the message bus cannot take the adapter's state now: {error}") from error
        self.directory.adapter_changed(state)
        log.info("adapter_changed", model=state.model, adapter=state.name, path=state.path, loaded=state.loaded)

    def _heartbeat(self, leaving: bool = False) -> GatewayHeartbeat:
        return GatewayHeartbeat(
            gateway_id=self.gateway_id, reply_to=self._reply_topic, interval_s=HEARTBEAT_INTERVAL_S, leaving=leaving
        )

    async def _send_heartbeats(self) -> None:
        """Tell workers this gateway still waits for its requests' tokens; check that its listeners still hear."""
        replies, control, *_ = self._listeners
        watched = [
            (self._reply_topic, replies, self._reply_echo),
            (self._control_topic, control, self._failover.workers),
        ]
        while True:
            for topic, listener, echo in watched:
                await send_own_heartbeat(self._bus, topic, self._heartbeat(), listener, echo)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _check_failovers(self) -> None:
        """Often: the sooner a dead worker is noticed, the sooner its streams go on elsewhere."""
        while True:
            self._failover.check()
            await asyncio.sleep(CHECK_EVERY_S)

    async def _measure_backlogs(self) -> None:
        """The workers' consumer lag on each served model's priority topics, as a gauge."""
        while True:
            await asyncio.sleep(BACKLOG_INTERVAL_S)
            for model in self.directory.model_names():
                await record_backlog(self._bus, self._metrics, self._settings.topic_prefix, model)

    def default_model_name(self) -> str:
        """The model of the routes that name none (/infer_token, /infer)."""
        if self._settings.default_model:
            return self._settings.default_model
        names = self.directory.model_names()
        if len(names) == 1:
            return names[0]
        if not names:
            raise unavailable("no worker is serving any model yet")
        raise not_found(f"several models are served ({', '.join(names)}) and no default is set (--default-model)")

    def resolve(self, name: str) -> ServedModel:
        """The served model clients call `name`; 404 if nobody serves it, 503 if nobody does now (or has yet)."""
        model = self.directory.announced(name)
        if not self.directory.live_workers(model.name):
            raise unavailable(self.bus_trouble() or f"no worker is serving model {name} right now")
        return model

    def bus_trouble(self) -> str | None:
        """Why nothing can be heard, when the bus is the reason: what a 503 should blame instead of the workers."""
        silent_s = self._failover.workers.silent_for(time.monotonic())
        if silent_s is None:
            return None
        return (
            f"{self._bus.where} has not carried this gateway's heartbeats for {silent_s:.0f} s: no worker can be heard"
        )

    @property
    def settings(self) -> GatewaySettings:
        return self._settings

    @staticmethod
    def draw_seed() -> int:
        """A seed for a request that gave none: drawn once, so a retry draws the same tokens."""
        return secrets.randbelow(2**63 - 1) + 1

    async def submit(
        self,
        model: ServedModel,
        sampling: SamplingParams,
        *,
        prompt_text: str | None = None,
        prompt_token_ids: list[int] | None = None,
        chat_messages: list[ChatMessage] | None = None,
        prompt_parts: list[ContentPart] | None = None,
        images: list[bytes] = (),
        tools: list[dict] | None = None,
        truncate: int | None = None,
        priority: int | None = None,
        timeout_s: int | None = None,
        tokens_before: int = 0,
        client_id: str | None = None,
        task: Task = "generate",
        tokenization: Tokenization | None = None,
    ) -> InFlight:
        """Publish a request for the model's workers; its events arrive on the returned InFlight.

        `client_id` is the id the client gave (stopInfer finds the request by it); `task` what the worker does
        with the prompt (schemas/messages.py), `tokenization` how a tokenize request's prompt is tokenized.
        """
        priority = priority or self._settings.default_priority
        tenant_name, tenant = self._tenancy.current() if self._tenancy is not None else (None, None)
        if tenant is not None:
            sampling, priority = self._tenancy.within_allowance(model, tenant_name, tenant, sampling, priority)
        now = time.time()
        generation_id = uuid.uuid4().hex
        trace_id = current_request_id() or generation_id
        request = GenerationRequest(
            task=task,
            request_id=generation_id,
            trace_id=trace_id,
            model=model.name,
            adapter=model.adapter,
            adapter_path=model.adapters[model.adapter] if model.adapter is not None else None,
            prompt_text=prompt_text,
            prompt_token_ids=prompt_token_ids,
            chat_messages=chat_messages,
            prompt_parts=prompt_parts,
            images=list(images),
            tools=tools,
            truncate=truncate,
            tokenization=tokenization,
            sampling=sampling,
            priority=priority,
            tenant=tenant_name,
            tenant_weight=tenant.weight if tenant is not None else 1.0,
            tokens_before=tokens_before,
            arrival=now,
            deadline=now + (timeout_s or self._settings.default_timeout_s),
            reply_to=self._reply_topic,
        )
        structlog.contextvars.bind_contextvars(generation_id=generation_id)
        if self.draining:
            self._metrics.failed(model.name, SERVICE_UNAVAILABLE)
            raise ApiError(
                503,
                SERVICE_UNAVAILABLE,
                "this gateway is shutting down; send the request to another one",
                headers={"Retry-After": "0", "Connection": "close"},
            )
        self._check_size(request)
        if len(self.inflight) >= self._settings.max_in_flight:
            raise self._refused(
                model,
                f"this gateway already has {len(self.inflight)} requests in flight, its limit (--max-in-flight)",
                reason="in-flight limit",
                in_flight=len(self.inflight),
            )
        limit = self._settings.max_waiting_requests
        if limit and (ahead := self._dispatcher.queue_ahead(request)) >= limit:
            raise self._refused(
                model,
                f"model {model.name} already has {ahead} requests waiting for a worker, its limit "
                "(--max-waiting-requests)",
                reason="waiting limit",
                waiting=ahead,
            )
        if tenant is not None and (refusal := self._tenancy.admit(tenant_name, tenant, request.request_id)):
            raise self._refused(model, refusal.message, reason=refusal.limit, retry_after_s=refusal.retry_after_s)
        inflight = self.inflight.open(request, client_id or request.request_id)
        inflight.on_tokens = functools.partial(self._tokens_served, inflight)
        inflight.on_end = functools.partial(self._record_usage, inflight, current_key_id())
        try:
            await self._dispatcher.dispatch(inflight)
        except (BusUnavailable, UnknownTopic) as error:
            self.inflight.close(request.request_id)
            self._tenant_ended(request.request_id)
            self._dispatcher.ended(inflight)
            inflight.timer.end(SERVICE_UNAVAILABLE, time.time(), failed=True)
            log.warning("publish_failed", error=str(error))
            raise unavailable(f"the message bus cannot take the request now: {error}") from error
        return inflight

    def _refused(
        self, model: ServedModel, message: str, reason: str, retry_after_s: int = RETRY_AFTER_S, **counts: int
    ) -> ApiError:
        """A 429 with Retry-After for a request past an admission limit, counted and logged."""
        self._metrics.failed(model.name, TOO_MANY_REQUESTS)
        log.warning("request_refused", reason=reason, **counts)
        return ApiError(429, TOO_MANY_REQUESTS, message, headers={"Retry-After": str(retry_after_s)})

    def _tokens_served(self, inflight: InFlight, count: int) -> None:
        """Tokens a request's events brought: for its tenant's fair share, and against its tenant's limits."""
        self._dispatcher.served(inflight, count)
        if (tenant := inflight.request.tenant) is not None and self._tenancy is not None:
            self._tenancy.tokens(tenant, count)

    async def _record_usage(self, inflight: InFlight, key_id: str | None, last: TokenEvent | None) -> None:
        """Publish the request's usage record (gateway/tenancy/usage.py), unless it has one; `last`: its last event, or
        None for a request dropped before its end."""
        if (record := self._usage.record(inflight, last, key_id)) is not None:
            await self._usage.publish(record)

    def _tenant_ended(self, request_id: str) -> None:
        if self._tenancy is not None:
            self._tenancy.ended(request_id)

    async def stop_requests(self, model_name: str, client_id: str) -> bool:
        """stopInfer: cancel the running requests of that client id, here or on another gateway.

        False if no gateway has one (none answered within STOP_ANSWER_TIMEOUT_S).
        """
        model = self.resolve(model_name)
        stopped = self.inflight.find(model.name, client_id)
        await self._stop(stopped)
        if stopped:
            return True
        question = StopClientRequest(
            model=model.name, client_id=client_id, question_id=uuid.uuid4().hex, reply_to=self._reply_topic
        )
        answer = self._stop_answers[question.question_id] = asyncio.get_running_loop().create_future()
        try:
            await self._bus.publish(self._control_topic, question)
            async with asyncio.timeout(STOP_ANSWER_TIMEOUT_S):
                return await answer > 0
        except TimeoutError:
            return False
        except (BusUnavailable, UnknownTopic) as error:
            raise unavailable(f"the message bus cannot take the stop request now: {error}") from error
        finally:
            del self._stop_answers[question.question_id]

    async def stop_traced(self, trace_id: str) -> bool:
        """Stop, as stopInfer does, the requests opened under this request id (a WebSocket stream's `<socket's
        id>/<stream id>`, whatever the API): their streams end with finish reason stop_sequence. False if none is
        open yet."""
        stopped = [inflight for inflight in self.inflight if inflight.request.trace_id == trace_id]
        await self._stop(stopped)
        return bool(stopped)

    async def _stop_for_another(self, question: StopClientRequest) -> None:
        """Another gateway was asked to stop a request of a client id: stop ours, and tell it so."""
        stopped = self.inflight.find(question.model, question.client_id)
        if not stopped:
            return
        try:
            await self._stop(stopped)
        except ApiError as error:  # the bus refuses now: the asking gateway answers 404 after its wait
            log.warning("cancel_not_published", client_id=question.client_id, error=error.body.error)
            return
        answer = StopAnswer(question_id=question.question_id, stopped=len(stopped))
        await self._bus.publish_or_log(question.reply_to, answer, "stop_answer_not_published")

    async def _stop(self, requests: list[InFlight]) -> None:
        """stopInfer: a request waiting in the gateway ends here; one a worker has is cancelled there."""
        for inflight in requests:
            inflight.stopped = True
            if self._dispatcher.release(inflight):
                inflight.stop_unstarted()
                self._metrics.cancelled(inflight.request.model, "stopInfer")
            else:
                await self._cancel(inflight, "stopInfer")

    async def _cancel(self, inflight: InFlight, reason: str) -> None:
        try:
            await self._bus.publish(
                self._control_topic,
                CancelRequest(
                    request_id=inflight.request.request_id, reason=reason, deadline=inflight.request.deadline
                ),
            )
        except (BusUnavailable, UnknownTopic) as error:
            raise unavailable(f"the message bus cannot take the cancellation now: {error}") from error
        self._metrics.cancelled(inflight.request.model, reason)
        log.info("request_cancelled", **inflight.request.log_ids(), reason=reason)

    def _check_size(self, request: GenerationRequest) -> None:
        """413 for a request larger on the bus than the bus carries: refused here, before it is published."""
        limit = self._bus.max_message_bytes
        if limit is not None and (size := len(encode(request))) > limit:
            raise ApiError(
                413,
                PAYLOAD_TOO_LARGE,
                f"the request takes {size} bytes on the message bus; at most {limit} are carried (--max-message-bytes)",
            )

    def finish(self, inflight: InFlight) -> None:
        """Forget a request; if its worker may still run it (client gone, deadline), tell it to stop.

        The cancellation (and the usage record of a request dropped before its
        end) is published by a task of its own: the caller is often being
        cancelled itself (its client left), which would cut an awaited publish
        short.
        """
        self.inflight.close(inflight.request.request_id)
        self._tenant_ended(inflight.request.request_id)
        self._dispatcher.ended(inflight)
        held = self._dispatcher.release(inflight)  # then no worker has it
        self._failover.forget(inflight, told_to_stop=not (inflight.worker_ended or held))
        inflight.timer.end(CLIENT_GONE, time.time())  # unless its last event ended it already
        if inflight.on_end is not None and not inflight.finished:  # dropped before its end: cancelled
            self._in_background(inflight.on_end(None))
        if inflight.worker_ended or held:
            return
        reason = "deadline passed" if inflight.finished else CLIENT_GONE
        self._in_background(self._cancel_quietly(inflight, reason))

    def _in_background(self, publishing: Coroutine[Any, Any, None]) -> None:
        """Publish in a task of its own, which stop() waits for."""
        task = asyncio.create_task(publishing)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _cancel_quietly(self, inflight: InFlight, reason: str) -> None:
        try:
            await self._cancel(inflight, reason)
        except ApiError as error:  # nobody to answer: the worker's own deadline ends the request
            log.warning("cancel_not_published", **inflight.request.log_ids(), error=error.body.error)
