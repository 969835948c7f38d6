"""`/ws`: every streaming API over a WebSocket, several streams per socket (see schemas/websocket.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing

import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from gateway.access_log import access, client_of, level_of
from gateway.bodies.ignored_fields import listed
from gateway.errors import VALIDATION_ERROR, ApiError, describe_validation_error, openai_error_body
from gateway.routes import mindie, openai, tgi, triton
from schemas.body import reading_body
from schemas.triton import GenerateStreamRequest
from schemas.websocket import (
    WsCancel,
    WsChatCompletions,
    WsClientMessage,
    WsCompletions,
    WsGenerateStream,
    WsInfer,
    WsMessage,
    WsStart,
    WsTgi,
)

router = APIRouter(tags=["WebSocket"])


class _Socket:
    """One client connection: its streams, and one writer at a time."""

    def __init__(self, websocket: WebSocket) -> None:
        self._websocket = websocket
        self.request_id: str = websocket.state.request_id  # gateway/access_log.py
        self.reject_unknown_fields: bool = websocket.app.state.gateway.settings.reject_unknown_fields
        self.client = client_of(websocket.scope)
        self._send_lock = asyncio.Lock()
        self.streams: dict[str, asyncio.Task] = {}
        self.cancelled: set[str] = set()  # streams the client cancelled
        self.stop_pending: set[str] = set()  # of those, the ones cancelled before their request was in flight
        self.started = 0  # streams started, for the connection's log line
        self.closed = False

    async def send(self, message: dict) -> None:
        async with self._send_lock:
            await self._websocket.send_json(message)

    async def fail(self, stream_id: str | None, error: ApiError, openai_shape: bool = False, ends: bool = True) -> None:
        """Send the error under `stream_id`, and (`ends`) that this id's stream is done."""
        if openai_shape:
            data = openai_error_body(error.status, error.body.error_type, error.body.error)
        else:
            data = error.body.model_dump()
        await self.send({"id": stream_id, "data": data})
        if stream_id is not None and ends:
            await self.send({"id": stream_id, "done": True})

    async def handle(self, raw: str) -> None:
        try:
            with reading_body(self.reject_unknown_fields) as reading:
                message = WsClientMessage.validate_json(raw)
        except ValidationError as error:
            text = "; ".join(describe_validation_error(e, WsMessage) for e in error.errors())
            stream_id = _id_in(raw)
            refused = ApiError(422, VALIDATION_ERROR, text)
            await self.fail(stream_id, refused, ends=stream_id not in self.streams)  # a stream under it goes on
            return
        stream_id = message.id or uuid.uuid4().hex
        ignored = listed(reading.ignored or {})
        if ignored:  # before the stream's first event: the fields of the message it ignored
            await self.send({"id": stream_id, "ignored_fields": ignored})
        if isinstance(message, WsCancel):
            await self.cancel(message.id)
            return
        if stream_id in self.streams:  # said under that id, but it is not done: the stream running under it goes on
            message_text = f"id {stream_id} is already streaming on this socket"
            await self.fail(stream_id, ApiError(422, VALIDATION_ERROR, message_text), ends=False)
            return
        self.started += 1
        self.streams[stream_id] = asyncio.create_task(self._stream(stream_id, message, ignored))

    async def cancel(self, stream_id: str) -> None:
        """Stop the stream's requests as stopInfer does: the stream ends with its API's last event, finish reason and
        all. A stream whose request is not in flight yet (still read, or submitted) is stopped once it is."""
        if stream_id not in self.streams or stream_id in self.cancelled:
            return
        self.cancelled.add(stream_id)
        if not await self._websocket.app.state.gateway.stop_traced(f"{self.request_id}/{stream_id}"):
            self.stop_pending.add(stream_id)

    async def _objects(self, stream_id: str, message: WsStart):
        """The stream's objects, from the route module of its API."""
        connection = self._websocket
        if isinstance(message, WsGenerateStream):
            body = GenerateStreamRequest(id=stream_id, text_input=message.text_input, parameters=message.parameters)
            return await triton.stream_objects(connection, message.model, body)
        if isinstance(message, WsInfer):
            return await mindie.stream_objects(connection, message.body)
        if isinstance(message, WsTgi):
            return await tgi.stream_objects(connection, message.body)
        if isinstance(message, WsCompletions):
            return await openai.completion_chunks(connection, message.body)
        assert isinstance(message, WsChatCompletions)
        return await openai.chat_chunks(connection, message.body)

    async def _stream(self, stream_id: str, message: WsStart, ignored: list[str]) -> None:
        request_id = f"{self.request_id}/{stream_id}"
        structlog.contextvars.bind_contextvars(request_id=request_id)  # this task's own context: its lines only
        started = time.perf_counter()
        outcome, status, events = "done", None, 0
        try:
            objects = await self._objects(stream_id, message)
            if stream_id in self.stop_pending:  # cancelled while its request was not in flight yet: it is now
                await self._websocket.app.state.gateway.stop_traced(request_id)
            async with aclosing(objects):  # closing it tells the worker to stop, if it has not ended
                async for obj in objects:
                    await self.send({"id": stream_id, "data": obj})
                    events += 1
            await self.send({"id": stream_id, "done": True})
            outcome = "cancelled" if stream_id in self.cancelled else outcome
        except ApiError as error:
            outcome, status = "error", error.status
            await self.fail(stream_id, error, openai_shape=isinstance(message, WsCompletions | WsChatCompletions))
        except asyncio.CancelledError:  # the socket closed, or its handler failed
            outcome = "socket_closed" if self.closed else "cancelled"
            if not self.closed:  # the client is still there: the stream is done
                await self.send({"id": stream_id, "done": True})
        except WebSocketDisconnect:
            outcome = "socket_closed"  # the stream's cleanup told the worker to stop
        finally:
            self.streams.pop(stream_id, None)
            self.cancelled.discard(stream_id)
            self.stop_pending.discard(stream_id)
            getattr(access, level_of(status or 200))(
                "websocket_stream",
                op=message.op,
                id=stream_id,
                request_id=request_id,
                outcome=outcome,
                status=status,
                events=events,
                latency_ms=round((time.perf_counter() - started) * 1000, 1),
                client=self.client,
                **({"ignored_fields": ignored} if ignored else {}),
            )


def _id_in(raw: str) -> str | None:
    """The `id` of a message that did not validate, when it has a usable one: its error is sent under it."""
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    stream_id = message.get("id") if isinstance(message, dict) else None
    return stream_id if isinstance(stream_id, str) and stream_id else None


@router.websocket("/ws")
async def websocket_streams(websocket: WebSocket) -> None:
    """Stream generate_stream events over a WebSocket; see schemas/websocket.py for the messages."""
    await websocket.accept()
    socket = _Socket(websocket)
    opened = time.perf_counter()
    close_code = None
    try:
        while True:
            await socket.handle(await websocket.receive_text())
    except WebSocketDisconnect as disconnect:
        close_code = disconnect.code
        # Streams still waiting for their first token would not notice by themselves.
        socket.closed = True
        for task in list(socket.streams.values()):
            task.cancel()
    finally:
        for task in list(socket.streams.values()):
            task.cancel()
        await asyncio.gather(*socket.streams.values(), return_exceptions=True)
        access.info(
            "websocket_connection",
            request_id=socket.request_id,
            client=socket.client,
            streams=socket.started,
            close_code=close_code,
            duration_ms=round((time.perf_counter() - opened) * 1000, 1),
        )
