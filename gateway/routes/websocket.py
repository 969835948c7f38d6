"""`/ws`: generate_stream over a WebSocket, several streams per socket (see schemas/websocket.py)."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing

import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from gateway.errors import VALIDATION_ERROR, ApiError, ErrorBody, describe_validation_error
from gateway.routes.triton import stream_objects
from schemas.triton import GenerateStreamRequest
from schemas.websocket import WsCancel, WsClientMessage, WsGenerateStream

router = APIRouter(tags=["WebSocket"])
log = structlog.get_logger(__name__)


class _Socket:
    """One client connection: its streams, and one writer at a time."""

    def __init__(self, websocket: WebSocket) -> None:
        self._websocket = websocket
        self._send_lock = asyncio.Lock()
        self.streams: dict[str, asyncio.Task] = {}
        self.closed = False

    async def send(self, message: dict) -> None:
        async with self._send_lock:
            await self._websocket.send_json(message)

    async def fail(self, stream_id: str | None, error_type: str, message: str) -> None:
        await self.send({"id": stream_id, "data": ErrorBody(error=message, error_type=error_type).model_dump()})
        if stream_id is not None:
            await self.send({"id": stream_id, "done": True})

    async def handle(self, raw: str) -> None:
        try:
            message = WsClientMessage.validate_json(raw)
        except ValidationError as error:
            text = "; ".join(describe_validation_error(e) for e in error.errors())
            await self.fail(None, VALIDATION_ERROR, text)
            return
        if isinstance(message, WsCancel):
            task = self.streams.get(message.id)
            if task is not None:
                task.cancel()
            return
        stream_id = message.id or uuid.uuid4().hex
        if stream_id in self.streams:
            await self.fail(None, VALIDATION_ERROR, f"id {stream_id} is already streaming on this socket")
            return
        self.streams[stream_id] = asyncio.create_task(self._stream(stream_id, message))

    async def _stream(self, stream_id: str, message: WsGenerateStream) -> None:
        body = GenerateStreamRequest(id=stream_id, text_input=message.text_input, parameters=message.parameters)
        try:
            objects = await stream_objects(self._websocket, message.model, body)
            async with aclosing(objects):  # closing it tells the worker to stop, if it has not ended
                async for obj in objects:
                    await self.send({"id": stream_id, "data": obj})
            await self.send({"id": stream_id, "done": True})
        except ApiError as error:
            await self.fail(stream_id, error.body.error_type, error.body.error)
        except asyncio.CancelledError:
            if not self.closed:  # cancelled by the client's message, not by the socket closing
                await self.send({"id": stream_id, "done": True})
        except WebSocketDisconnect:
            pass  # the socket closed; the stream's cleanup told the worker to stop
        finally:
            self.streams.pop(stream_id, None)


@router.websocket("/ws")
async def websocket_streams(websocket: WebSocket) -> None:
    """Stream generate_stream events over a WebSocket; see schemas/websocket.py for the messages."""
    await websocket.accept()
    socket = _Socket(websocket)
    try:
        while True:
            await socket.handle(await websocket.receive_text())
    except WebSocketDisconnect:
        # Streams still waiting for their first token would not notice by themselves.
        socket.closed = True
        for task in list(socket.streams.values()):
            task.cancel()
    finally:
        for task in list(socket.streams.values()):
            task.cancel()
        await asyncio.gather(*socket.streams.values(), return_exceptions=True)
