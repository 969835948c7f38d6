"""A stop that reaches a worker before its request does (they travel on two topics): the request ends with its
last event, as a running one would; a failover's fence of an old attempt is not answered.

A real worker (workers/worker.py) on the in-process bus, around a simulated model (no torch).
Without the answer, the gateway of a stopped WebSocket stream or stopInfer waited for a request its worker
had skipped, failed it over each time the worker's heartbeats did not list it, and after eight attempts ended
it with an error (test_end_to_end's WebSocket cancel, on Kafka, under load).
"""

from __future__ import annotations

import asyncio
import time

from bus.inprocess import InProcessBus
from bus.topics import control_topic, reply_topic, request_topics
from schemas.messages import CancelRequest, FinishReason, GenerationRequest, TokenEvent, TokenEvents
from tests.test_gateway_state import _request as gateway_request
from tests.test_simulated import PROFILE
from workers.engine.config import EngineConfig
from workers.settings import WorkerSettings
from workers.simulated.model import SimulatedModel
from workers.worker import Worker

PREFIX = "tokenrelay"
REPLIES = reply_topic(PREFIX, "g")


def _request(request_id: str, attempt: int) -> GenerationRequest:
    """A failover's request: two tokens were delivered before."""
    update = {"model": "tiny", "generated_token_ids": [5, 6], "reply_to": REPLIES}
    return gateway_request(request_id, attempt=attempt).model_copy(update=update)


async def test_a_request_stopped_before_it_came_ends_with_its_last_event_and_a_fenced_attempt_is_not_answered():
    bus = InProcessBus()
    model = SimulatedModel(PROFILE)
    worker = Worker(bus, model, model.engine_config(EngineConfig()), ["tiny"], WorkerSettings(worker_id="w"))
    await bus.create_topics({REPLIES: 1})
    replies = await bus.listen(REPLIES)
    await worker.start()
    running = asyncio.create_task(worker.run())
    try:
        control = control_topic(PREFIX)
        deadline = time.time() + 60
        await bus.publish(
            control, CancelRequest(request_id="fenced", reason="failover", deadline=deadline, attempts_before=1)
        )
        await bus.publish(control, CancelRequest(request_id="stopped", reason="stopInfer", deadline=deadline))
        for _ in range(500):  # both heard (the worker remembers them) before their requests come
            if {"fenced", "stopped"} <= worker._cancelled.keys():
                break
            await asyncio.sleep(0.01)
        topic = request_topics(PREFIX, "tiny")[-1]
        await bus.publish(topic, _request("fenced", attempt=0))
        await bus.publish(topic, _request("stopped", attempt=1))
        events: list[TokenEvent] = []

        async def collect() -> None:
            async for batch in replies:
                assert isinstance(batch, TokenEvents)
                events.extend(batch.events)

        collecting = asyncio.create_task(collect())
        for _ in range(1000):
            if any(e.request_id == "stopped" for e in events):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # and nothing for the fenced attempt meanwhile, or after
        collecting.cancel()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await worker.stop()
        await replies.close()
    [last] = events
    assert (last.request_id, last.attempt, last.index) == ("stopped", 1, 2)  # after the two delivered tokens
    assert last.finish_reason == FinishReason.STOP_SEQUENCE and last.error is None and last.token_ids == []
