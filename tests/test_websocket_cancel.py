"""A WebSocket `cancel` stops its stream as stopInfer does: the stream ends with its API's last event, finish reason
and all, then `done`, even when the cancel came before the stream's request was in flight.

The gateway's socket handler (gateway/routes/websocket.py) on a real gateway service and in-process bus; this
test plays the WebSocket's transport and the worker, which answers the stop with its last event as a worker does.
tests/test_end_to_end.py cancels streams over a real WebSocket to `tokenrelay serve` and a Kafka topology.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from bus.inprocess import InProcessBus
from bus.topics import control_topic, request_topics
from gateway.media.loader import MediaLoader
from gateway.routes.websocket import _Socket
from gateway.service import GatewayService
from gateway.settings import GatewaySettings, MediaPolicy
from schemas.messages import CancelRequest, FinishReason, TokenEvent
from tests.test_gateway_state import _heartbeat

START = {"op": "generate_stream", "model": "tiny", "id": "s", "text_input": "x", "parameters": {"details": True}}


async def _soon(condition, what: str):
    for _ in range(500):
        if found := condition():
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {what} within 5 s")


async def _first_cancel(control) -> CancelRequest:
    async for message in control:  # gateways' heartbeats share the topic
        if isinstance(message, CancelRequest):
            return message


async def test_a_cancel_before_the_request_is_in_flight_ends_the_stream_with_its_finish_reason(tmp_path: Path):
    bus = InProcessBus()
    service = GatewayService(bus, GatewaySettings())
    await service.start()
    await bus.create_topics({topic: 1 for topic in request_topics("tokenrelay", "tiny")})
    control = await bus.listen(control_topic("tokenrelay"))
    service.directory.observe(_heartbeat("w1", ["tiny"]))
    sent: list[dict] = []

    async def send_json(message: dict) -> None:
        sent.append(message)

    app = SimpleNamespace(state=SimpleNamespace(gateway=service, media=MediaLoader(MediaPolicy(media_dir=tmp_path))))
    transport = SimpleNamespace(
        app=app, state=SimpleNamespace(request_id="sock"), scope={"client": ("127.0.0.1", 1)}, send_json=send_json
    )
    socket = _Socket(transport)
    try:
        await socket.handle(json.dumps(START))
        await socket.handle(json.dumps({"op": "cancel", "id": "s"}))  # its stream has not even run yet
        assert socket.stop_pending == {"s"}
        [inflight] = await _soon(lambda: list(service.inflight), "request in flight")
        request_id = inflight.request.request_id
        inflight.deliver(TokenEvent(request_id=request_id, index=0, token_ids=[7], text="a", prompt_tokens=1), "w1")
        await _soon(lambda: inflight.stopped, "stop")  # once its first event came: it is in flight, and stopped
        said = await asyncio.wait_for(_first_cancel(control), 5)  # what its worker is told: stopInfer's words
        assert (said.request_id, said.reason) == (request_id, "stopInfer")
        last = TokenEvent(
            request_id=request_id, index=1, token_ids=[8], text="b", finish_reason=FinishReason.STOP_SEQUENCE
        )
        inflight.deliver(last, "w1")  # what the worker answers a cancel with
        await asyncio.wait_for(socket.streams["s"], 5)
    finally:
        await control.close()
        await service.stop()
    assert [message.get("done") for message in sent] == [None, None, True]
    assert sent[-2]["data"]["details"]["finish_reason"] == "stop_sequence"
    assert sent[-2]["data"]["text_output"] == "b" and socket.stop_pending == set()
