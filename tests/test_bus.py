"""The bus contract, run against every implementation: in-process, in-process through its socket, real Kafka."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from bus.base import Bus, UnknownTopic
from bus.inprocess import InProcessBus
from bus.kafka import KafkaBus
from bus.local import LocalBus, LocalBusServer
from bus.settings import KafkaSettings
from bus.topics import request_topics
from schemas.messages import CancelRequest, GenerationRequest, SamplingParams


@pytest.fixture(params=["inprocess", "local", pytest.param("kafka", marks=pytest.mark.kafka)])
async def bus(request, tmp_path) -> Bus:
    """local: an in-process bus through its Unix-socket server, as `tokenrelay serve`'s engine process sees it."""
    server = None
    if request.param == "inprocess":
        instance: Bus = InProcessBus()
    elif request.param == "local":
        server = LocalBusServer(InProcessBus(), str(tmp_path / "bus.sock"))
        await server.start()
        instance = LocalBus(str(tmp_path / "bus.sock"), metrics=lambda: b"")
    else:
        bootstrap = request.getfixturevalue("kafka_bootstrap")
        instance = KafkaBus(KafkaSettings(bootstrap_servers=bootstrap, session_timeout_ms=6000), client_id="test")
    await instance.start()
    yield instance
    await instance.close()
    if server is not None:
        await server.close()


def _request(priority: int, label: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=label,
        model="m",
        prompt_text=label,
        sampling=SamplingParams(seed=1),
        priority=priority,
        arrival=time.time(),
        deadline=time.time() + 60,
        reply_to="r",
    )


async def _next(listener, timeout_s: float = 10.0):
    iterator = listener.__aiter__()
    return await asyncio.wait_for(anext(iterator), timeout_s), iterator


async def test_a_listener_sees_what_is_published_after_it_opened(bus, topic_prefix):
    topic = f"{topic_prefix}.control"
    await bus.create_topics({topic: 1})
    await bus.publish(topic, CancelRequest(request_id="before", reason="x", deadline=0.0))
    listener = await bus.listen(topic)
    try:
        for label in ("a", "b", "c"):
            await bus.publish(topic, CancelRequest(request_id=label, reason="x", deadline=0.0))
        first, iterator = await _next(listener)
        second = await asyncio.wait_for(anext(iterator), 10)
        third = await asyncio.wait_for(anext(iterator), 10)
        assert [m.request_id for m in (first, second, third)] == ["a", "b", "c"]
    finally:
        await listener.close()


async def test_every_listener_sees_every_message(bus, topic_prefix):
    topic = f"{topic_prefix}.control"
    await bus.create_topics({topic: 1})
    listeners = [await bus.listen(topic), await bus.listen(topic)]
    try:
        await bus.publish(topic, CancelRequest(request_id="all", reason="x", deadline=0.0))
        for listener in listeners:
            message, _ = await _next(listener)
            assert message.request_id == "all"
    finally:
        for listener in listeners:
            await listener.close()


async def test_replay_delivers_the_recent_past(bus, topic_prefix):
    topic = f"{topic_prefix}.control"
    await bus.create_topics({topic: 1})
    await bus.publish(topic, CancelRequest(request_id="earlier", reason="x", deadline=0.0))
    listener = await bus.listen(topic, replay_s=30)
    try:
        message, _ = await _next(listener)
        assert message.request_id == "earlier"
    finally:
        await listener.close()


def _accept_all(delivery) -> bool:
    return True


def _aged_request(priority: int, label: str, waited_s: float) -> GenerationRequest:
    return _request(priority, label).model_copy(update={"arrival": time.time() - waited_s})


async def test_requests_are_offered_most_urgent_first_with_aging_and_refused_ones_wait(bus, topic_prefix):
    topics = request_topics(topic_prefix, "m")
    await bus.create_topics({t: 2 for t in topics})
    group = f"{topic_prefix}.workers"
    queue = await bus.open_request_queue(topics, group, aging_s=10.0)
    offered: list[str] = []

    def refuse(delivery) -> bool:
        offered.append(delivery.request.request_id)
        return False

    try:
        await queue.take(refuse, timeout_s=0.5)  # join the group before anything is published
        await bus.publish(topics[2], _request(3, "fresh-3"))
        await bus.publish(topics[4], _aged_request(5, "aged-5", waited_s=25))  # as urgent as a 2.5 now
        await bus.publish(topics[0], _request(1, "urgent-1"))
        deadline = time.monotonic() + 20
        while queue.waiting() < 3 and time.monotonic() < deadline:  # fetched (they may come one by one)
            assert await queue.take(refuse, timeout_s=0.5) == []
        offered.clear()
        assert await queue.take(refuse, timeout_s=0.5) == []
        assert offered == ["urgent-1", "aged-5", "fresh-3"]

        assert await bus.backlog(topics, group) == dict(zip(topics, [1, 0, 1, 0, 1], strict=True))
        taken = await queue.take(lambda d: d.request.request_id == "aged-5", timeout_s=0.5)
        assert [d.request.request_id for d in taken] == ["aged-5"]
        rest = await queue.take(_accept_all, timeout_s=0.5)
        assert [d.request.request_id for d in rest] == ["urgent-1", "fresh-3"]
        for delivery in taken + rest:
            queue.finished(delivery)
        await queue.take(refuse, timeout_s=0.1)  # Kafka commits what is finished when polled
        assert await bus.backlog(topics, group) == dict.fromkeys(topics, 0)
    finally:
        await queue.close()


@pytest.mark.kafka
async def test_unfinished_requests_go_to_the_next_member_and_finished_ones_do_not(kafka_bootstrap, topic_prefix):
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, session_timeout_ms=6000)
    bus = KafkaBus(settings, client_id="test")
    await bus.start()
    topics = request_topics(topic_prefix, "m")
    group = f"{topic_prefix}.workers"
    try:
        await bus.create_topics({t: 1 for t in topics})
        for label in ("one", "two", "three"):
            await bus.publish(topics[4], _request(5, label))
        first = await bus.open_request_queue(topics, group)
        taken = []
        while len(taken) < 3:
            taken.extend(await first.take(_accept_all, timeout_s=1))
        assert [d.request.request_id for d in taken] == ["one", "two", "three"]
        first.finished(taken[0])
        first.finished(taken[2])  # "two" is left unfinished, as by a crash
        await first.close()

        second = await bus.open_request_queue(topics, group)
        again = []
        deadline = time.monotonic() + 30
        while len(again) < 2 and time.monotonic() < deadline:
            again.extend(await second.take(_accept_all, timeout_s=1))
        # Committed up to the first unfinished request: "two" comes back, and
        # "three" with it (at least once); "one" never does.
        assert [d.request.request_id for d in again] == ["two", "three"]
        await second.close()
    finally:
        await bus.close()


async def test_publishing_to_a_topic_nobody_created_fails_in_process():
    bus = InProcessBus()
    with pytest.raises(UnknownTopic):
        await bus.publish(f"nowhere.{uuid.uuid4().hex}", CancelRequest(request_id="x", reason="x", deadline=0.0))


async def test_a_reply_whose_caller_was_cancelled_leaves_the_socket_bus_working(tmp_path, topic_prefix):
    """serve's engine process: a publish cancelled while its reply is on the way (a drain's, a stop's) must not
    kill the reader, which the engine process exits with (a drain under load failed so)."""
    server = LocalBusServer(InProcessBus(), str(tmp_path / "bus.sock"))
    await server.start()
    bus = LocalBus(str(tmp_path / "bus.sock"), metrics=lambda: b"")
    await bus.start()
    topic = f"{topic_prefix}.t"
    await bus.create_topics({topic: 1})
    cancelled = asyncio.create_task(bus.publish(topic, CancelRequest(request_id="x", reason="x", deadline=0.0)))
    await asyncio.sleep(0)  # sent; its reply not read yet
    cancelled.cancel()
    async with asyncio.timeout(10):  # answered: the reader lives (a dead one would leave it waiting for ever)
        await bus.publish(topic, CancelRequest(request_id="y", reason="y", deadline=0.0))
    assert cancelled.cancelled() and not bus._reading.done()
    await bus.close()
    await server.close()


async def test_a_rebuilt_listener_goes_on_where_it_stopped(bus, topic_prefix):
    topic = f"{topic_prefix}.control"
    await bus.create_topics({topic: 1})
    listener = await bus.listen(topic)
    try:
        for label in ("a", "b"):
            await bus.publish(topic, CancelRequest(request_id=label, reason="x", deadline=0.0))
        first, iterator = await _next(listener)
        await listener.rebuild()
        await bus.publish(topic, CancelRequest(request_id="c", reason="x", deadline=0.0))
        rest = [await asyncio.wait_for(anext(iterator), 10) for _ in range(2)]
        assert [m.request_id for m in (first, *rest)] == ["a", "b", "c"]  # none lost, none twice
    finally:
        await listener.close()


@pytest.mark.kafka
async def test_a_request_consumer_that_stops_fetching_is_rebuilt_and_gets_the_waiting_request(
    kafka_bootstrap, topic_prefix
):
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, session_timeout_ms=6000, consumer_stuck_s=1.0)
    bus = KafkaBus(settings, client_id="test")
    await bus.start()
    topics = request_topics(topic_prefix, "m")
    try:
        await bus.create_topics({t: 1 for t in topics})
        queue = await bus.open_request_queue(topics, f"{topic_prefix}.workers")
        while not queue._consumer.assignment():
            await queue.take(_accept_all, timeout_s=0.2)
        assert not await queue.revive_if_stuck()  # nothing waits: not stuck
        stuck = queue._consumer

        async def fetch_nothing(*args, **kwargs):  # what a consumer stuck after a reconnect does
            await asyncio.sleep(0.1)
            return {}

        stuck.getmany = fetch_nothing
        await bus.publish(topics[0], _request(1, "waiting"))
        assert await queue.take(_accept_all, timeout_s=0.2) == []
        deadline = time.monotonic() + 20
        while not await queue.revive_if_stuck():
            assert time.monotonic() < deadline, "the stuck consumer was not noticed"
            await queue.take(_accept_all, timeout_s=0.2)
        taken = []
        while not taken and time.monotonic() < deadline + 20:
            taken = await queue.take(_accept_all, timeout_s=0.5)
        assert [d.request.request_id for d in taken] == ["waiting"]
        await queue.close()
    finally:
        await bus.close()
