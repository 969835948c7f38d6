"""The gateway's router and dispatcher, on load reports alone, over the in-process bus."""

from __future__ import annotations

import asyncio

from bus.inprocess import InProcessBus
from bus.prefixes import CHUNK_BYTES, prefix_hashes
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.inflight import InFlight
from gateway.dispatch.router import ADAPTER_LOAD_TOKENS, Router
from schemas.messages import ChatMessage, GenerationRequest, SamplingParams, WorkerLoad
from workers.load_report import LoadReporter


def _load(worker: str, running: int = 0, capacity: int = 4, prefixes=(), **fields) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker,
        model="m",
        inbox=f"inbox.{worker}",
        capacity=capacity,
        running=running,
        waiting=fields.pop("waiting", 0),
        running_by_priority=fields.pop("running_by_priority", [0, 0, 0, 0, running]),
        kv_blocks=100,
        free_kv_blocks=fields.pop("free_kv_blocks", 100 - running),
        block_size=16,
        prefixes_added=list(prefixes),
        snapshot=fields.pop("snapshot", True),
        interval_s=1.0,
        **fields,
    )


def _request(text: str = "x", priority: int = 5, **fields) -> GenerationRequest:
    return GenerationRequest(
        request_id=fields.pop("request_id", "r"),
        model=fields.pop("model", "m"),
        prompt_text=text,
        sampling=SamplingParams(seed=1),
        priority=priority,
        arrival=0.0,
        deadline=1e12,
        reply_to="replies",
        **fields,
    )


def test_equal_prompt_prefixes_share_their_hashes_and_a_next_turn_extends_them():
    system = ChatMessage(role="system", content="s" * 600)
    first = [system, ChatMessage(role="user", content="u" * 300)]
    turn = _request(chat_messages=first, text=None)
    next_turn = _request(chat_messages=[*first, ChatMessage(role="assistant", content="a" * 200)], text=None)
    hashes, longer = prefix_hashes(turn), prefix_hashes(next_turn)
    assert len(hashes) == (len("\x1esystem\x1f") + 600 + len("\x1euser\x1f") + 300) // CHUNK_BYTES
    assert longer[: len(hashes)] == hashes and len(longer) > len(hashes)
    assert prefix_hashes(_request(text="t" * 1000, truncate=10)) == []


def test_the_worker_with_room_that_holds_most_of_the_prompt_wins_and_the_load_breaks_ties():
    router = Router("replies")
    request = _request("p" * 2048)
    hashes = prefix_hashes(request)
    router.observe(_load("cold"))
    router.observe(_load("warm", running=2, prefixes=hashes[:6]))
    router.observe(_load("warmest-but-full", running=4, capacity=4, waiting=1, prefixes=hashes))
    route = router.choose("m", 5, hashes)
    assert (route.worker_id, route.inbox) == ("warm", "inbox.warm")
    assert route.cached_tokens == 6 * CHUNK_BYTES // 4
    assert route.worth_waiting_s == 0.0  # the full one reports no prompt cost yet
    assert router.choose("m", 5, []).worker_id == "cold"  # nothing cached anywhere: the least busy
    assert router.choose("other model", 5, hashes) is None


def test_a_next_turn_sent_before_the_workers_report_of_its_cache_follows_its_conversation():
    router = Router("replies")
    turn = _request(chat_messages=[ChatMessage(role="user", content="u" * 1000)], text=None)
    hashes = prefix_hashes(turn)
    reply = ChatMessage(role="assistant", content="a" * 200)
    next_turn = prefix_hashes(_request(chat_messages=[*turn.chat_messages, reply], text=None))
    # The last reports of both: as busy as each other, neither holding the conversation yet.
    router.observe(_load("a", running=1, snapshot=False))
    router.observe(_load("b", running=1, snapshot=False))
    assert router.choose("m", 5, next_turn).cached_tokens == 0
    router.holds("b", hashes)  # b's first event of the turn: its prompt is in b's cache
    route = router.choose("m", 5, next_turn)
    assert route.worker_id == "b" and route.cached_tokens == len(hashes) * CHUNK_BYTES // 4
    # A snapshot of b's prefixes without the prompt (evicted, or never kept) clears the hint.
    router.observe(_load("b", running=1))
    assert router.choose("m", 5, next_turn).cached_tokens == 0
    router.holds("gone", hashes)  # a worker it does not know: nothing to hold it


def test_a_draining_worker_gets_nothing_more_even_holding_the_whole_prompt():
    router = Router("replies")
    request = _request("p" * 2048)
    hashes = prefix_hashes(request)
    router.observe(_load("warm", prefixes=hashes))
    router.observe(_load("cold", running=3))
    assert router.choose("m", 5, hashes).worker_id == "warm"
    router.observe(_load("warm", prefixes=hashes, draining=True))
    assert router.choose("m", 5, hashes).worker_id == "cold"
    router.observe(_load("cold", running=3, draining=True))
    assert router.choose("m", 5, hashes) is None and not router.knows("m")  # to the shared topics, then


def test_a_full_worker_has_room_for_a_more_urgent_request_it_would_preempt_for():
    router = Router("replies")
    router.observe(_load("w", running=4, capacity=4, waiting=1, running_by_priority=[0, 0, 1, 0, 3]))
    assert router.choose("m", 5, []) is None
    assert router.choose("m", 3, []) is not None  # three priority-5 requests to preempt


def test_routes_count_against_a_worker_until_a_report_shows_them_read():
    router = Router("replies")
    router.observe(_load("w", running=0, capacity=4))
    routes = []
    while (route := router.choose("m", 5, [])) is not None:
        router.routed(route)
        routes.append(route)
    assert len(routes) == 4 + 1  # its free slots and one read ahead
    router.observe(_load("w", running=0, capacity=4))  # sent before it read them: no room still
    assert router.choose("m", 5, []) is None
    router.observe(_load("w", running=2, waiting=1, capacity=4, inbox_reads={"replies": 3, "other gateway": 7}))
    assert router.choose("m", 5, []) is None  # 3 held, 2 on their way
    router.observe(_load("w", running=4, capacity=4, inbox_reads={"replies": 5}))
    assert router.choose("m", 5, []) is not None  # the read-ahead again
    router.observe(_load("w", running=0, capacity=4, inbox_reads={"replies": 1}))  # restarted under its id
    assert len([router.routed(r) for _ in range(5) if (r := router.choose("m", 5, []))]) == 5


def test_a_failover_avoids_the_worker_it_broke_off_on_unless_no_other_has_room():
    router = Router("replies")
    router.observe(_load("a"))
    router.observe(_load("b", running=3))
    assert router.choose("m", 5, [], avoid="a").worker_id == "b"
    router.observe(_load("b", running=4, waiting=1))
    assert router.choose("m", 5, [], avoid="a").worker_id == "a"


def test_waiting_for_the_cached_worker_is_worth_the_time_it_would_save():
    router = Router("replies")
    hashes = prefix_hashes(_request("p" * 4096))
    router.observe(_load("cold"))
    router.observe(_load("full", running=4, waiting=1, prefixes=hashes, seconds_per_prompt_token=0.001))
    route = router.choose("m", 5, hashes)
    assert route.worker_id == "cold"
    assert route.worth_waiting_s == len(hashes) * CHUNK_BYTES // 4 * 0.001


def test_removed_prefixes_stop_counting_and_a_snapshot_replaces_them():
    router = Router("replies")
    hashes = prefix_hashes(_request("p" * 1024))
    router.observe(_load("w", prefixes=hashes))
    delta = _load("w", prefixes=[]).model_copy(update={"snapshot": False, "prefixes_removed": hashes[2:]})
    router.observe(delta)
    assert router.choose("m", 5, hashes).cached_tokens == 2 * CHUNK_BYTES // 4
    router.observe(_load("w", prefixes=[]))
    assert router.choose("m", 5, hashes).cached_tokens == 0


async def _received(bus: InProcessBus, topic: str):
    return await bus.listen(topic, replay_s=60)


async def test_a_request_no_worker_has_room_for_waits_in_the_gateway_and_goes_to_the_first_with_room():
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1, "inbox.b": 1, "t.m.p5": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    running = asyncio.create_task(dispatcher.run())
    try:
        first = InFlight(_request(request_id="first"), "c1")
        await dispatcher.dispatch(first)  # no worker reports yet: the shared queue
        assert first.worker_id is None and not dispatcher.release(first)
        router.observe(_load("a", running=4, waiting=1))
        router.observe(_load("b", running=4, waiting=1))
        second = InFlight(_request(request_id="second"), "c2")
        await dispatcher.dispatch(second)
        assert second.worker_id is None  # held
        router.observe(_load("b", running=3))
        dispatcher.room_may_have_changed()
        for _ in range(100):
            if second.worker_id is not None:
                break
            await asyncio.sleep(0.01)
        assert second.worker_id == "b"
        assert not dispatcher.release(second)  # no longer held
        listener = await _received(bus, "inbox.b")
        message = await asyncio.wait_for(anext(aiter(listener)), 1)
        assert message.request_id == "second"
    finally:
        running.cancel()


async def test_a_held_request_that_ends_is_released_and_never_sent():
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    router.observe(_load("a", running=4, waiting=1))
    held = InFlight(_request(request_id="gone"), "c")
    await dispatcher.dispatch(held)
    assert dispatcher.release(held) and not dispatcher.release(held)


async def test_a_held_request_goes_to_the_shared_queue_once_no_worker_reports_any_more():
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1, "t.m.p5": 1})
    shared = await bus.listen("t.m.p5")
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    running = asyncio.create_task(dispatcher.run())
    try:
        router.observe(_load("a", running=4, waiting=1))
        held = InFlight(_request(request_id="orphan"), "c")
        await dispatcher.dispatch(held)
        router.forget("a")  # it left
        dispatcher.room_may_have_changed()
        message = await asyncio.wait_for(anext(aiter(shared)), 2)
        assert message.request_id == "orphan" and not dispatcher.release(held)
    finally:
        running.cancel()


def test_an_adapters_requests_go_where_it_is_resident_until_those_workers_are_full_then_spread():
    router = Router("replies")
    router.observe(_load("a", running=2, adapters=["shout"]))
    router.observe(_load("b", running=0, adapters=["code"]))
    assert router.choose("m", 5, [], adapter="shout").worker_id == "a"  # busier, but it holds the adapter
    assert router.choose("m", 5, [], adapter="code").worker_id == "b"
    assert router.choose("m", 5, []).worker_id == "b"  # the base model: the load alone decides
    full = 4 + 1  # capacity and read-ahead
    router.observe(_load("a", running=full, adapters=["shout"], running_by_priority=[0, 0, 0, 0, full]))
    assert router.choose("m", 5, [], adapter="shout").worker_id == "b"  # no room where it is: b loads it


def test_the_prefix_names_of_a_prompt_under_an_adapter_are_not_the_base_models():
    text = "t" * 600
    base, shout = prefix_hashes(_request(text=text)), prefix_hashes(_request(text=text, adapter="shout"))
    assert len(base) == len(shout) == 2 and not set(base) & set(shout)
    assert prefix_hashes(_request(text=text, adapter="shout")) == shout


def test_a_load_goes_where_it_evicts_no_adapters_only_copy_and_names_the_slots_to_take():
    router = Router("replies")
    one_slot = {"adapter_slots": 1, "seconds_per_prompt_token": 0.001}
    router.observe(_load("a", adapters=["shout"], idle_adapters=["shout"], **one_slot))
    router.observe(_load("b", adapters=["code"], idle_adapters=["code"], **one_slot))
    router.observe(_load("c", running=1, **one_slot))  # its slot is free
    route = router.choose("m", 5, [], adapter="poem")
    assert (route.worker_id, route.evict_adapters_first, route.worth_waiting_s) == ("c", (), 0.0)
    # Where every slot holds an only copy, a load costs two; where one holds a copy that another worker has too,
    # one: it goes there, and tells the worker which slot to take.
    router.observe(_load("c", running=1, adapters=["code"], idle_adapters=["code"], **one_slot))
    route = router.choose("m", 5, [], adapter="poem")
    assert (route.worker_id, route.evict_adapters_first, route.worth_waiting_s) == ("b", ("code",), 0.0)
    assert router.choose("m", 5, [], adapter="shout").worker_id == "a"  # where it is, at no load


def test_a_request_waits_for_its_adapters_worker_as_long_as_the_load_is_priced():
    router = Router("replies")
    full = {"running": 5, "running_by_priority": [0, 0, 0, 0, 5]}  # capacity 4 and read-ahead 1
    router.observe(_load("a", adapters=["shout"], adapter_slots=1, seconds_per_prompt_token=0.001, **full))
    router.observe(_load("b", adapters=["code"], idle_adapters=["code"], adapter_slots=2))
    route = router.choose("m", 5, [], adapter="shout")  # b's free slot: one load's worth of a's time
    assert route.worker_id == "b" and route.worth_waiting_s == ADAPTER_LOAD_TOKENS * 0.001
    router.observe(_load("b", adapters=["code", "poem"], idle_adapters=["code", "poem"], adapter_slots=2))
    route = router.choose("m", 5, [], adapter="shout")  # an only copy evicted: two loads' worth
    assert route.worker_id == "b" and route.worth_waiting_s == 2 * ADAPTER_LOAD_TOKENS * 0.001
    assert router.choose("m", 5, [], adapter="shout", avoid="a").worth_waiting_s == 0  # it broke off there


async def test_the_dispatcher_sends_the_router_s_slots_to_take_with_the_request():
    bus = InProcessBus()
    router = Router("replies")
    one_slot = {"adapter_slots": 1}
    router.observe(_load("a", adapters=["shout"], idle_adapters=["shout"], **one_slot))
    router.observe(_load("b", adapters=["shout"], idle_adapters=["shout"], **one_slot))
    await bus.create_topics({"inbox.a": 1})
    inbox = await _received(bus, "inbox.a")
    await Dispatcher(bus, router, "t").dispatch(InFlight(_request(request_id="poem", adapter="poem"), "c"))
    message = await asyncio.wait_for(anext(aiter(inbox)), 2)
    assert message.request_id == "poem" and message.evict_adapters_first == ["shout"]


def test_a_worker_reads_ahead_only_requests_it_needs_no_load_for():
    router = Router("replies")
    router.observe(_load("a", running=4, adapters=["shout"], adapter_slots=4))  # its slots full, read-ahead free
    assert router.choose("m", 5, [], adapter="shout").worker_id == "a"
    assert router.choose("m", 5, []).worker_id == "a"
    assert router.choose("m", 5, [], adapter="code") is None  # which slot frees, and what it evicts, is not known


async def test_a_held_adapter_request_with_no_room_does_not_hold_back_those_after_it():
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    running = asyncio.create_task(dispatcher.run())
    try:
        router.observe(_load("a", running=5, adapters=["shout"], adapter_slots=4))  # read ahead already
        first = InFlight(_request(request_id="code", adapter="code"), "c1")
        second = InFlight(_request(request_id="shout", adapter="shout"), "c2")
        for held in (first, second):
            await dispatcher.dispatch(held)
        inbox = await _received(bus, "inbox.a")
        router.observe(_load("a", running=4, adapters=["shout"], adapter_slots=4))  # read it: room ahead again
        dispatcher.room_may_have_changed()
        message = await asyncio.wait_for(anext(aiter(inbox)), 2)
        assert message.request_id == "shout" and second.worker_id == "a" and first.worker_id is None
        assert dispatcher.release(first) and not dispatcher.release(second)
    finally:
        running.cancel()


async def test_a_request_waits_behind_the_held_and_the_routed_not_started_unless_a_worker_has_room_for_it():
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1, "inbox.b": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    router.observe(_load("a", running=4, waiting=1))  # full, its read-ahead taken
    router.observe(_load("b", running=3))
    assert dispatcher.queue_ahead(_request()) == 0  # b has a free slot
    await dispatcher.dispatch(InFlight(_request(request_id="to-b"), "c"))  # routed, not read yet
    assert router.waiting("m") == 1 + 1 and dispatcher.queue_ahead(_request()) == 0  # b's read-ahead
    await dispatcher.dispatch(InFlight(_request(request_id="to-b-ahead"), "c"))
    for held in ("h1", "h2"):
        await dispatcher.dispatch(InFlight(_request(request_id=held), "c"))  # no room: held here
    assert dispatcher.queue_ahead(_request()) == 2 + (1 + 2)  # held here, waiting at a, unread at b
    assert dispatcher.queue_ahead(_request(priority=1)) == 0  # it would preempt a priority-5 request
    assert dispatcher.queue_ahead(_request(model="other")) == 0  # no worker of it reports: the shared queue
    assert Dispatcher(bus, None, "t").queue_ahead(_request()) == 0  # no routing: the backlog is not seen


async def test_held_requests_of_one_priority_go_out_by_their_tenants_fair_share_not_first_come():
    """A heavy tenant's three requests wait when a light tenant's comes: as a slot frees at a time, the light one
    goes after one heavy one (whose prompt then counts), not after all three."""
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    router.observe(_load("a", running=4, waiting=1))
    for name, tenant in (("h1", "heavy"), ("h2", "heavy"), ("h3", "heavy"), ("l1", "light")):
        await dispatcher.dispatch(InFlight(_request(text="x" * 400, request_id=name, tenant=tenant), name))
    sent: list[str] = []

    async def read() -> None:
        async for message in await _received(bus, "inbox.a"):
            sent.append(message.request_id)

    tasks = [asyncio.create_task(dispatcher.run()), asyncio.create_task(read())]
    try:
        for count in range(1, 5):
            # One slot free (none to read ahead), and every request routed there before read.
            router.observe(_load("a", running=3, waiting=1, inbox_reads={"replies": count - 1}))
            dispatcher.room_may_have_changed()
            for _ in range(200):
                if len(sent) == count:
                    break
                await asyncio.sleep(0.01)
    finally:
        for task in tasks:
            task.cancel()
    assert sent == ["h1", "l1", "h2", "h3"]


async def test_a_request_of_a_tenant_far_below_another_s_share_goes_past_a_full_worker_s_room_by_one():
    """The worker is full, and the heavy tenant has been served far more than the light one: the light tenant's
    request is sent anyway (the worker preempts a heavy sequence for it), once; the heavy tenant's is held."""
    bus = InProcessBus()
    await bus.create_topics({"inbox.a": 1})
    router = Router("replies")
    dispatcher = Dispatcher(bus, router, "t")
    router.observe(_load("a", running=4, waiting=1))
    heavy = InFlight(_request(request_id="h", tenant="heavy"), "h")
    await dispatcher.dispatch(heavy)
    dispatcher.served(heavy, 5_000)
    light = [InFlight(_request(request_id=f"l{i}", tenant="light"), f"l{i}") for i in range(2)]
    for inflight in light:
        dispatcher.release(heavy)  # so that each light request is tried at once, not behind the held one
        await dispatcher.dispatch(inflight)
    assert [f.worker_id for f in light] == ["a", None]  # one past the room; the next waits for a report
    assert heavy.worker_id is None
    sent = await asyncio.wait_for(anext(aiter(await _received(bus, "inbox.a"))), 1)
    assert (sent.request_id, sent.preempt_for_share) == ("l0", True)  # marked: the worker preempts for it


async def test_a_worker_reports_its_load_as_it_starts_not_a_heartbeat_later():
    """A gateway hears a starting worker's heartbeat (the model is ready) and its load together: a request sent
    between the two would go to the shared queue, unrouted (test_kafka_transport waited a second for it)."""
    bus = InProcessBus()
    await bus.create_topics({"routing": 1})
    routing = await bus.listen("routing")
    identity = {"worker_id": "w", "model": "m", "inbox": "inbox.w"}
    load = _load("w").model_dump(include={"capacity", "running", "waiting", "running_by_priority", "kv_blocks"})
    load |= {"free_kv_blocks": 100, "block_size": 16}
    reporter = LoadReporter(bus, "routing", identity, interval_s=60.0, load=lambda: load)
    reporting = asyncio.create_task(reporter.run())
    try:
        async with asyncio.timeout(5):
            report = await anext(aiter(routing))
    finally:
        reporting.cancel()
    router = Router("replies")
    router.observe(report)
    assert router.knows("m") and report.worker_id == "w" and report.interval_s == 60.0
