"""Which worker a request goes to: the one with room that would compute the least of it.

Workers report on the routing topic their inbox, their load and the prompt
prefixes they hold in KV cache (workers/load_report.py). For a request the
router considers the workers of its model whose report is fresh and that
have room: a free slot (counting what this gateway routed to them that
their report does not show read yet, and a few requests of read-ahead, so
that a slot that frees is filled at once), or a running request of a lower
priority, which the
worker preempts. Among them it takes the lowest cost, as NVIDIA Dynamo's KV
router does: the prompt tokens the worker does not hold cached, weighted,
plus the tokens its running requests keep in cache. The weight is higher
than Dynamo's 1, from what a step costs (workers/simulated/profile.py): a
prompt token to compute costs as much as a cached token attended to by
every step of a few hundred output tokens, and the room check already
keeps a worker that holds a popular prefix from taking more than it can
run. A request of a LoRA adapter costs more on a worker that would have to
load it into a device slot (its report lists the adapters it holds), and
twice that where the slot it would take holds the only copy of another
adapter among the model's workers (whose next request would then load it
again). So an adapter's requests go where it is resident while those
workers have room, and wait for them as long as computing the load's price
would take, then spread; a load goes where it evicts an adapter that
another worker holds too, which the request names to the worker; and a
worker reads no request ahead that it would have to load an adapter for:
which of its slots frees, and so what a load would evict, and whether a
worker holding the adapter frees one first, is known only from the report
after it frees. Each worker then keeps a few adapters, and each adapter few
workers. With no worker that has room, the request waits in the gateway
(dispatcher.py). A route is a hint: a stale one costs latency, never a
request, since whatever a worker holds is failed over if it dies.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from bus.prefixes import CHUNK_BYTES
from schemas.messages import GenerationRequest, WorkerLoad

PREFILL_WEIGHT = 16.0  # Dynamo's overlap_score_weight: a prompt token to compute against a token held in cache
BYTES_PER_TOKEN = 4  # to turn the prefix names' bytes into tokens
STALE_AFTER_REPORTS = 3  # a worker whose report is older than this many intervals gets no route
# Loading an adapter into a device slot, in the cost's units: as much as computing 512 prompt tokens, far
# more than its copy takes. A weight like PREFILL_WEIGHT, it trades a request's wait for its adapter's worker
# against loads and the evictions they cause: `tokenrelay bench scale --adapters 32` (32 adapters on 8
# workers of 4 slots, saturated) measured 5x fewer loads than adapter-blind placement at 512, 10-13x at
# 1,024, for 10% more TTFT p99.
ADAPTER_LOAD_TOKENS = 512


def _adapter_load(load: WorkerLoad, copies: Counter[str]) -> tuple[int, list[str]]:
    """Loading an adapter on a worker: its cost in prompt tokens, and the adapters in its slots that other workers
    hold too (the slots it should take first). The cost is one load, and one more when the slot it must take
    holds the only copy of another adapter among the model's workers: that adapter's next request loads it too."""
    shared = [name for name in load.adapters if copies[name] > 1]
    if len(load.adapters) < load.adapter_slots or any(name in shared for name in load.idle_adapters or load.adapters):
        return ADAPTER_LOAD_TOKENS, shared
    return 2 * ADAPTER_LOAD_TOKENS, shared


def read_ahead(capacity: int) -> int:
    """Requests routed beyond a worker's free slots: enough that a slot that frees never waits for a gateway."""
    return max(1, capacity // 8)


@dataclass
class _WorkerView:
    load: WorkerLoad
    heard_at: float
    prefixes: set[int] = field(default_factory=set)
    routed: int = 0  # requests this gateway routed to it, all told
    read: int = 0  # of those, the ones its last report shows it has read from its inbox

    @property
    def unread(self) -> int:
        """Routed by this gateway, and not in its report yet (a report sent before it read them shows none)."""
        return max(0, self.routed - self.read)

    def room(self, priority: int, ahead: bool = True, beyond: int = 0) -> int:
        """Requests of `priority` it would take now: free slots and, with `ahead`, its read-ahead (and `beyond`
        more); else the running requests it would preempt."""
        ahead_of_slots = read_ahead(self.load.capacity) if ahead else 0
        free = self.load.capacity + ahead_of_slots + beyond - self.load.running - self.load.waiting - self.unread
        if free > 0:
            return free
        return sum(self.load.running_by_priority[priority:])  # running ones it would preempt

    def cached_tokens(self, hashes: list[int]) -> int:
        held = 0
        for prefix in hashes:  # a prefix counts only if all before it is held too
            if prefix not in self.prefixes:
                break
            held += 1
        return held * CHUNK_BYTES // BYTES_PER_TOKEN

    def busy_tokens(self) -> int:
        """Tokens its running requests keep in cache (Dynamo's active blocks)."""
        return (self.load.kv_blocks - self.load.free_kv_blocks) * self.load.block_size


@dataclass(frozen=True)
class Route:
    worker_id: str
    inbox: str
    cached_tokens: int  # of the prompt, as the router estimates
    # How long waiting for the worker that holds the most of the prompt (with room or not) is worth:
    # what computing the tokens it holds beyond this route's would take it.
    worth_waiting_s: float
    evict_adapters_first: tuple[str, ...] = ()  # should the worker load the request's adapter (GenerationRequest)


class Router:
    def __init__(self, reply_to: str) -> None:
        """`reply_to`: this gateway's reply topic, under which workers count what they read from it."""
        self._reply_to = reply_to
        self._workers: dict[str, _WorkerView] = {}

    def observe(self, load: WorkerLoad) -> None:
        if load.draining:
            self.forget(load.worker_id)
            return
        view = self._workers.get(load.worker_id)
        read = load.inbox_reads.get(self._reply_to, 0)
        if view is None or read < view.read:  # new to it, or the worker restarted under the same id
            view = self._workers[load.worker_id] = _WorkerView(load, time.monotonic(), routed=read)
        if load.snapshot:
            view.prefixes = set(load.prefixes_added)
        else:
            view.prefixes.difference_update(load.prefixes_removed)
            view.prefixes.update(load.prefixes_added)
        view.load, view.heard_at, view.read = load, time.monotonic(), read

    def forget(self, worker_id: str) -> None:
        """The worker left or drains: route nothing more to it."""
        self._workers.pop(worker_id, None)

    def knows(self, model: str) -> bool:
        """Whether some worker of the model reports its load (else requests go to the shared queue)."""
        return any(view.load.model == model and self._fresh(view) for view in self._workers.values())

    def has_room(self, request: GenerationRequest) -> bool:
        """Whether some worker of the request's model has room for a request of its priority that needs no load."""
        return any(
            view.load.model == request.model and self._fresh(view) and view.room(request.priority) > 0
            for view in self._workers.values()
        )

    def waiting(self, model: str) -> int:
        """Requests routed to the model's workers and not started: unread in their inboxes, or read and waiting."""
        return sum(
            view.load.waiting + view.unread
            for view in self._workers.values()
            if view.load.model == model and self._fresh(view)
        )

    def _fresh(self, view: _WorkerView) -> bool:
        return time.monotonic() - view.heard_at <= STALE_AFTER_REPORTS * view.load.interval_s

    def choose(
        self,
        model: str,
        priority: int,
        hashes: list[int],
        avoid: str | None = None,
        adapter: str | None = None,
        beyond: int = 0,
    ) -> Route | None:
        """The worker to route a request to, or None: none has room (or none reported).

        `avoid`: a worker to take only if no other has room (the one a failed-over request broke off on);
        `adapter`: the LoRA adapter the request is generated under; `beyond`: requests a worker may take past its
        room (one whose tenant is far below its share: the worker preempts for it, schemas/fair_share.py).
        """
        views = [view for view in self._workers.values() if view.load.model == model and self._fresh(view)]
        copies = Counter(name for view in views for name in view.load.adapters)
        best: tuple[bool, float, int, _WorkerView, int, int, list[str]] | None = None
        most_cached, most_cached_view = 0, None
        least_load, least_load_view = 2 * ADAPTER_LOAD_TOKENS, None  # the cheapest adapter load, with room or not
        for view in views:
            load = view.load
            cached = view.cached_tokens(hashes)
            if cached > most_cached:
                most_cached, most_cached_view = cached, view
            load_tokens, evict_first = 0, []
            if adapter is not None and adapter not in load.adapters:
                load_tokens, evict_first = _adapter_load(load, copies)
            if load_tokens < least_load and load.worker_id != avoid:
                least_load, least_load_view = load_tokens, view
            if view.room(priority, ahead=not load_tokens, beyond=beyond) <= 0:  # no read-ahead for a load (above)
                continue
            uncached = len(hashes) * CHUNK_BYTES // BYTES_PER_TOKEN - cached
            cost = PREFILL_WEIGHT * (uncached + load_tokens) + view.busy_tokens()
            key = (load.worker_id == avoid, cost, load.running + load.waiting + view.unread)
            if best is None or key < best[:3]:
                best = (*key, view, cached, load_tokens, evict_first)
        if best is None:
            return None
        view, cached, load_tokens, evict_first = best[3:]
        worth = 0.0
        if most_cached_view is not None and most_cached_view.load.worker_id != avoid:
            worth = (most_cached - cached) * most_cached_view.load.seconds_per_prompt_token
        if least_load_view is not None and load_tokens > least_load:  # a cheaper load (or none) may free first
            worth = max(worth, (load_tokens - least_load) * least_load_view.load.seconds_per_prompt_token)
        return Route(view.load.worker_id, view.load.inbox, cached, worth, tuple(evict_first))

    def holds(self, worker_id: str, hashes: list[int]) -> None:
        """The worker's first event of a request says its prompt's prefixes (`hashes`) are in its cache now. Its
        report of them comes a tenth of a second or more later: a next turn sent sooner (an agent's, the moment
        an answer ends) follows its conversation all the same. A prompt the worker did not keep (no prefix cache,
        or evicted since) is a stale hint until its next snapshot of its prefixes."""
        if (view := self._workers.get(worker_id)) is not None:
            view.prefixes.update(hashes)

    def routed(self, route: Route) -> None:
        """The request went where `route` says: count it against that worker's room until a report shows it read."""
        self._count(route, 1)

    def unrouted(self, route: Route) -> None:
        """The request counted by routed() could not be sent after all."""
        self._count(route, -1)

    def _count(self, route: Route, change: int) -> None:
        view = self._workers.get(route.worker_id)
        if view is not None:
            view.routed += change
