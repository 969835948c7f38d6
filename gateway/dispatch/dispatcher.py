"""Sending a request where it will run: the inbox of the worker the router picks, as soon as one has room.

A request that no worker has room for now waits here, most urgent first
(its priority, aged by its wait; within a priority, the tenant furthest below
its fair share first: schemas/fair_share.py), and goes out as soon as a load report
shows room: a worker's free slot, its read-ahead (router.py), or a running
request of a lower priority that it would preempt. Waiting here rather than
in a topic that only some workers read means that whichever worker frees a
slot first gets the next request: no worker idles while a request waits for
another. One exception trades a little waiting for computing: a request
whose prompt a worker without room holds cached, more of it than any
worker with room, waits for that worker's next free slot as long as that
worker would take to compute the difference (as a conversation's next turn
does); the clock runs only while some other worker has room.

Until the router has heard of any worker of the model (a gateway that just
started), or when routing is off (`--no-router`), requests go to the
request topics that all the model's workers share, as before routing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter

import structlog
from prometheus_client import Gauge

from bus.base import Bus, BusUnavailable, UnknownTopic
from bus.prefixes import prompt_bytes
from bus.topics import request_topic
from gateway.dispatch.inflight import InFlight
from gateway.dispatch.router import Route, Router
from schemas.fair_share import RETURN_CREDIT, FairShare
from schemas.messages import GenerationRequest

log = structlog.get_logger(__name__)

HELD = Gauge(
    "tokenrelay_gateway_requests_held",
    "Requests waiting in the gateway for a worker with room (the queue to scale workers on).",
    ["model"],
)
_RETRY_S = 0.5  # a held request the bus refused is tried again this soon, or at the next load report
_BYTES_PER_TOKEN = 4  # a prompt's tokens, until its worker counts them: about 4 bytes of English each
FAIR_READ_AHEAD = 1  # requests a worker is sent past its room for tenants far below their share


class Dispatcher:
    def __init__(self, bus: Bus, router: Router | None, topic_prefix: str, aging_s: float = 10.0) -> None:
        """`router` None: every request goes to the shared request topics (the placement before routing)."""
        self._bus = bus
        self._router = router
        self._topic_prefix = topic_prefix
        self._aging_s = aging_s
        # -> since when another worker than the one holding its prompt had room (time.monotonic())
        self._held: dict[InFlight, float] = {}
        self._held_by_model: Counter[str] = Counter()
        self._held_by_tenant: Counter[str | None] = Counter()
        # Tokens its tenants were served through this gateway: their prompts' estimated when sent (the estimate
        # prepaid, InFlight.prepaid_tokens), then what their events bring beyond it.
        self._fair_share = FairShare(return_credit=RETURN_CREDIT)
        self._fair_counted: set[InFlight] = set()  # the requests it counts as its tenants' here, until they end
        self._wake = asyncio.Event()

    def queue_ahead(self, request: GenerationRequest) -> int:
        """Requests of its model that `request` would wait behind: none where a worker has room for it now (a
        free slot, read-ahead, or a running request of a lower priority to preempt), else those held here and
        those routed to workers and not started. Without routing, none: the shared topics' backlog is unseen."""
        if self._router is None or self._router.has_room(request):
            return 0
        return self._held_by_model[request.model] + self._router.waiting(request.model)

    def room_may_have_changed(self) -> None:
        """A load report came: try the held requests again."""
        if self._held:
            self._wake.set()

    async def dispatch(self, inflight: InFlight) -> None:
        """Publish the request's current attempt now, or hold it until a worker has room. While others of its
        model are held, it is held too: the held queue's order (priority, then fair share) decides which goes
        first, not which came while a report showed room.

        Raises what Bus.publish raises when it publishes now.
        """
        if inflight not in self._fair_counted:  # a failover dispatches it again: it arrived once
            self._fair_counted.add(inflight)
            self._fair_share.arrived(inflight.request.tenant)
        if self._held_by_model[inflight.request.model] or await self._send(inflight, time.monotonic()) != _SENT:
            self._held[inflight] = time.monotonic()
            self._held_by_model[inflight.request.model] += 1
            self._held_by_tenant[inflight.request.tenant] += 1
            HELD.labels(inflight.request.model).inc()
            log.info("request_held", **inflight.request.log_ids(), held=len(self._held))
            self._wake.set()  # a wait for a cache ends by the clock, not by a report

    def release(self, inflight: InFlight) -> bool:
        """Stop holding the request (it ended here); whether it was held."""
        if self._held.pop(inflight, None) is None:
            return False
        self._held_by_model[inflight.request.model] -= 1
        self._held_by_tenant[inflight.request.tenant] -= 1
        HELD.labels(inflight.request.model).dec()
        return True

    def ended(self, inflight: InFlight) -> None:
        """The request ended (its tenant's fair share no longer counts it among its requests here)."""
        if inflight in self._fair_counted:
            self._fair_counted.discard(inflight)
            self._fair_share.left(inflight.request.tenant)

    def served(self, inflight: InFlight, tokens: int) -> None:
        """Tokens its events brought (its prompt's once, and each generated): charged to its tenant beyond what
        was prepaid for its prompt when it was sent."""
        prepaid = min(inflight.prepaid_tokens, tokens)
        inflight.prepaid_tokens -= prepaid
        if tokens > prepaid:
            self._fair_share.charge(inflight.request.tenant, inflight.request.tenant_weight, tokens - prepaid)

    def _sent(self, inflight: InFlight) -> None:
        """It left for a worker: its prompt's estimated tokens are charged (once: not again after a failover)."""
        request = inflight.request
        if request.attempt == 0:
            estimate = len(request.prompt_token_ids or ()) or len(prompt_bytes(request)) // _BYTES_PER_TOKEN
            inflight.prepaid_tokens = estimate
            self._fair_share.charge(request.tenant, request.tenant_weight, estimate)

    async def _send(self, inflight: InFlight, held_since: float) -> str:
        """Publish to a worker's inbox, or to the shared queue when no worker reports: _SENT, else why not."""
        outcome = await self._publish_routed(inflight, held_since)
        if outcome == _NO_WORKER:
            topic = request_topic(self._topic_prefix, inflight.request.model, inflight.request.priority)
            await self._bus.publish(topic, inflight.request)
            log.info("request_queued", **inflight.request.log_ids(), topic=topic)
            outcome = _SENT
        if outcome == _SENT:
            self._sent(inflight)
        return outcome

    def _choose(self, inflight: InFlight) -> tuple[Route | None, bool]:
        """The router's choice for the request, and whether it is past the worker's room: for a request whose
        tenant is far below another's share and has no other request waiting here, by one if need be (the worker
        preempts for it: schemas/fair_share.py). A tenant with a backlog here is served by the fair order alone:
        preempting for it too would give it more than its share."""
        request = inflight.request
        choice = functools.partial(
            self._router.choose,
            request.model,
            request.priority,
            inflight.prefix_hashes,
            inflight.broke_off_on,
            request.adapter,
        )
        if (route := choice()) is not None:
            return route, False
        others_held = self._held_by_tenant[request.tenant] - (inflight in self._held)
        if request.tenant is not None and not others_held and self._fair_share.far_below(request.tenant):
            return choice(beyond=FAIR_READ_AHEAD), True
        return None, False

    async def _publish_routed(self, inflight: InFlight, held_since: float) -> str:
        """Publish to the inbox of the worker the router picks: _SENT, _NO_ROOM, _WAITING (for the worker that
        has its prompt cached), or _NO_WORKER (routing is off, or no worker of the model reports)."""
        request = inflight.request
        if self._router is None or not self._router.knows(request.model):
            return _NO_WORKER
        while True:
            route, past_room = self._choose(inflight)
            if route is None:
                return _NO_ROOM
            if time.monotonic() - held_since < route.worth_waiting_s:
                return _WAITING
            self._router.routed(route)  # before the await: requests dispatched meanwhile see it
            marks = {"evict_adapters_first": list(route.evict_adapters_first)} if route.evict_adapters_first else {}
            marks |= {"preempt_for_share": True} if past_room else {}
            sent = request.model_copy(update=marks) if marks else request
            try:
                await self._bus.publish(route.inbox, sent)
            except UnknownTopic:
                self._router.forget(route.worker_id)  # it left, and its inbox with it
                continue
            except BaseException:
                self._router.unrouted(route)  # never sent: no report will show it read
                raise
            if inflight.request is request:  # else it failed over meanwhile, and that attempt is sent anew
                inflight.routed_to(route.worker_id)
            log.info(
                "request_routed",
                **request.log_ids(),
                attempt=request.attempt,
                worker_id=route.worker_id,
                past_room=past_room,
                cached_tokens=route.cached_tokens,
            )
            return _SENT

    def _order(self, inflight: InFlight, now: float) -> tuple[int, float, float]:
        request = inflight.request
        return self._fair_share.order(request.tenant, request.urgency(now, self._aging_s))

    async def run(self) -> None:
        """Send held requests, most urgent first, whenever reports show room (or a wait for a cache ends)."""
        while True:
            try:
                async with asyncio.timeout(_RETRY_S if self._held else None):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            now = time.time()
            waiting_for_cache = False
            for inflight in sorted(self._held, key=lambda f: self._order(f, now)):
                if inflight not in self._held:
                    continue  # ended meanwhile
                try:
                    outcome = await self._send(inflight, self._held[inflight])
                except (BusUnavailable, UnknownTopic) as error:
                    log.warning("held_request_not_published", **inflight.request.log_ids(), error=str(error))
                    break
                request = inflight.request
                if outcome == _NO_ROOM and request.adapter is not None and self._router.has_room(request):
                    # Its room was narrower than others' (a worker that must load its adapter reads none
                    # ahead, router.py): those after it may have some. Its wait counts from when it has room.
                    self._held[inflight] = time.monotonic()
                    continue
                if outcome == _NO_ROOM:
                    # No room for the most urgent held, none for the less urgent either; the wait for
                    # a worker with the prompt cached counts only from when another has room.
                    for waiting in self._held:
                        self._held[waiting] = time.monotonic()
                    break
                if outcome == _WAITING:
                    waiting_for_cache = True
                else:
                    self.release(inflight)
                    self._wake.set()  # the order again: its tenant's share has moved (schemas/fair_share.py)
                    break
            if waiting_for_cache:
                await asyncio.sleep(0.01)  # waits for a cache end by the clock too
                self._wake.set()


_SENT, _NO_ROOM, _WAITING, _NO_WORKER = "sent", "no room", "waiting for its cache", "no worker"
