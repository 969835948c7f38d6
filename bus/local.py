"""One process's in-process bus, lent to its child processes over a Unix socket.

`tokenrelay serve` runs its engine in a process of its own (so that the
gateway's HTTP work does not take the interpreter lock from the model's
steps, as vLLM's engine core does) yet keeps one bus and no broker: the
serve process holds the `InProcessBus` and a `LocalBusServer`; the engine
process's worker talks to it through `LocalBus`, a `Bus` like any other.

Frames are a header (kind, id, body length) and a body: bus messages as
their JSON encoding, calls and replies as JSON. A request queue is fed from
the server side: what the in-process queue hands out is sent to the child at
once, which offers it to its worker as Kafka's fetched requests are, and
says when each is finished. The server also asks its children for their
Prometheus metrics, so that the serve process's /metrics has the engine's,
and tells them when to drain and stop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import structlog

from bus.base import Bus, BusUnavailable, Delivery, HandedRequests, Listener, RequestQueue, UnknownTopic
from schemas.messages import BusMessage, GenerationRequest, decode, encode

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">BII")  # kind, id, body length
# Child -> server
_CALL, _PUBLISH, _FINISHED, _METRICS = 1, 2, 3, 4
# Server -> child
_REPLY, _ERROR, _MESSAGE, _DELIVERY, _METRICS_ASKED, _STOP_ASKED = 11, 12, 13, 14, 15, 16
_TAKE_WAIT_S = 1.0


async def _read(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    kind, ident, length = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return kind, ident, await reader.readexactly(length)


def _write(writer: asyncio.StreamWriter, kind: int, ident: int, body: bytes) -> None:
    writer.write(_HEADER.pack(kind, ident, len(body)) + body)


def _take_all(_: Delivery) -> bool:
    return True


class LocalBusServer:
    """Serves `bus` to the processes that connect to the Unix socket at `path`.

    It listens from its creation, before any event loop runs: a child started
    at once (its model loading while this process builds the rest) may
    connect before start(), and waits in the backlog until then.
    """

    def __init__(self, bus: Bus, path: str) -> None:
        self._bus = bus
        self._listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listening.bind(path)
        self._listening.listen()
        self._server: asyncio.Server | None = None
        self._children: set[_Child] = set()
        self.connected = asyncio.Event()  # a child has connected

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, sock=self._listening)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self._listening.close()
        for child in list(self._children):
            await child.close()

    async def ask_to_stop(self) -> None:
        """Tell every connected child to stop: the first time to drain, the second to stop at once."""
        for child in self._children:
            await child.ask_to_stop()

    async def metrics(self) -> bytes:
        """The Prometheus text of every connected child."""
        texts = await asyncio.gather(*(child.metrics() for child in self._children), return_exceptions=True)
        return b"".join(text for text in texts if isinstance(text, bytes))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        child = _Child(self._bus, writer)
        self._children.add(child)
        self.connected.set()
        try:
            await child.serve(reader)
        finally:
            self._children.discard(child)
            await child.close()


class _Child:
    """The server's side of one connected process: its listeners, request queues and pending questions."""

    def __init__(self, bus: Bus, writer: asyncio.StreamWriter) -> None:
        self._bus = bus
        self._writer = writer
        self._ids = itertools.count(1)
        self._listeners: dict[int, tuple[Listener, asyncio.Task]] = {}
        self._queues: dict[int, tuple[RequestQueue, asyncio.Task]] = {}
        self._deliveries: dict[int, tuple[RequestQueue, Delivery]] = {}
        self._metrics: dict[int, asyncio.Future[bytes]] = {}

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                kind, ident, body = await _read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if kind == _PUBLISH:
                topic, key, payload = body.split(b"\0", 2)  # an empty key: none
                await self._answer(ident, self._bus.publish(topic.decode(), decode(payload), key.decode() or None))
            elif kind == _CALL:
                await self._answer(ident, self._call(json.loads(body)))
            elif kind == _FINISHED and (taken := self._deliveries.pop(ident, None)) is not None:
                queue, delivery = taken
                queue.finished(delivery)
            elif kind == _METRICS and (asked := self._metrics.pop(ident, None)) is not None:
                asked.set_result(body)

    async def _answer(self, ident: int, call: Awaitable) -> None:
        try:
            result = await call
        except UnknownTopic as error:
            _write(self._writer, _ERROR, ident, json.dumps({"unknown_topic": str(error)}).encode())
        except BusUnavailable as error:
            _write(self._writer, _ERROR, ident, json.dumps({"unavailable": str(error)}).encode())
        else:
            _write(self._writer, _REPLY, ident, json.dumps(result).encode())
        await self._writer.drain()

    async def _call(self, call: dict):
        op = call["op"]
        if op == "create_topics":
            return await self._bus.create_topics(call["partitions"], call["compacted"])
        if op == "delete_topics":
            return await self._bus.delete_topics(call["topics"])
        if op == "backlog":
            return await self._bus.backlog(call["topics"], call["group"])
        if op == "listen":  # ids are the child's: what they name may arrive before the reply
            listener = await self._bus.listen(call["topic"], call["replay_s"], call["from_start"])
            self._listeners[call["id"]] = (listener, asyncio.create_task(self._forward(call["id"], listener)))
            return None
        if op == "open_request_queue":
            queue = await self._bus.open_request_queue(call["topics"], call["group"], call["aging_s"])
            self._queues[call["id"]] = (queue, asyncio.create_task(self._feed(call["id"], queue)))
            return None
        if op in ("close_listener", "close_request_queue"):
            closing, task = (self._listeners if op == "close_listener" else self._queues).pop(call["id"])
            task.cancel()
            return await closing.close()
        raise ValueError(f"unknown call {op}")

    async def _forward(self, ident: int, listener: Listener) -> None:
        async for message in listener:
            _write(self._writer, _MESSAGE, ident, encode(message))
            await self._writer.drain()

    async def _feed(self, ident: int, queue: RequestQueue) -> None:
        """What the queue hands out goes to the child at once; the child offers it to its worker."""
        while True:
            for delivery in await queue.take(_take_all, _TAKE_WAIT_S):
                delivery_id = next(self._ids)
                self._deliveries[delivery_id] = (queue, delivery)
                header = f"{ident}\0{delivery.source}\0".encode()
                _write(self._writer, _DELIVERY, delivery_id, header + encode(delivery.request))
            await self._writer.drain()

    async def ask_to_stop(self) -> None:
        _write(self._writer, _STOP_ASKED, 0, b"")
        await self._writer.drain()

    async def metrics(self) -> bytes:
        ident = next(self._ids)
        asked = self._metrics[ident] = asyncio.get_running_loop().create_future()
        _write(self._writer, _METRICS_ASKED, ident, b"")
        await self._writer.drain()
        async with asyncio.timeout(5.0):
            return await asked

    async def close(self) -> None:
        for closing, task in [*self._listeners.values(), *self._queues.values()]:
            task.cancel()
            await closing.close()
        self._listeners.clear()
        self._queues.clear()
        self._writer.close()


class LocalBus(Bus):
    """A child process's bus: the parent's `LocalBusServer`, at the Unix socket `path`."""

    def __init__(
        self,
        path: str,
        metrics: Callable[[], bytes],
        max_message_bytes: int | None = None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """`metrics()`: this process's Prometheus text, for the parent's /metrics; `on_lost()`: the server went
        away (the serve process's engine then exits: nobody reads what it would make)."""
        self._path = path
        self._metrics = metrics
        self._on_lost = on_lost
        # What the server's ask to stop does (as a signal would): set by the process that runs on this bus.
        self.stop_asked: Callable[[], None] = lambda: None
        self.max_message_bytes = max_message_bytes
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[bytes]] = {}
        self._listeners: dict[int, asyncio.Queue[BusMessage]] = {}
        self._queues: dict[int, _LocalRequestQueue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self._path)
        self._reading = asyncio.create_task(self._read(reader))

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            await self._follow(reader)
        except Exception:  # a reader that died would leave every call waiting for ever
            log.exception("bus_client_failed", path=self._path)
            self._on_lost()
            raise

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        assert self._writer is not None
        while True:
            try:
                kind, ident, body = await _read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.error("bus_server_gone", path=self._path)
                for reply in self._replies.values():
                    if not reply.done():
                        reply.set_exception(BusUnavailable("the bus server is gone"))
                self._replies.clear()
                self._writer.close()
                self._on_lost()
                return
            if kind in (_REPLY, _ERROR):
                reply = self._replies.pop(ident)
                if reply.done():  # its caller was cancelled (a drain, a stop) while it waited: nobody wants it
                    continue
                if kind == _REPLY:
                    reply.set_result(json.loads(body))
                else:
                    error = json.loads(body)
                    failure = UnknownTopic if "unknown_topic" in error else BusUnavailable
                    reply.set_exception(failure(next(iter(error.values()))))
            elif kind == _MESSAGE:
                self._listeners[ident].put_nowait(decode(body))
            elif kind == _DELIVERY:
                queue_id, topic, payload = body.split(b"\0", 2)
                request = decode(payload)
                assert isinstance(request, GenerationRequest)
                self._queues[int(queue_id)].arrived(Delivery(request, (topic.decode(), ident)))
            elif kind == _METRICS_ASKED:
                _write(self._writer, _METRICS, ident, self._metrics())
            elif kind == _STOP_ASKED:
                self.stop_asked()

    async def _ask(self, kind: int, body: bytes):
        if self._writer is None or self._writer.is_closing():
            raise BusUnavailable("not connected to the serve process")
        ident = next(self._ids)
        reply = self._replies[ident] = asyncio.get_running_loop().create_future()
        _write(self._writer, kind, ident, body)
        await self._writer.drain()
        return await reply

    async def _call(self, op: str, **arguments):
        return await self._ask(_CALL, json.dumps({"op": op, **arguments}).encode())

    async def publish(self, topic: str, message: BusMessage, key: str | None = None) -> None:
        await self._ask(_PUBLISH, topic.encode() + b"\0" + (key or "").encode() + b"\0" + encode(message))

    async def create_topics(self, partitions: Mapping[str, int], compacted: bool = False) -> None:
        await self._call("create_topics", partitions=dict(partitions), compacted=compacted)

    async def delete_topics(self, topics: Sequence[str]) -> None:
        await self._call("delete_topics", topics=list(topics))

    async def backlog(self, topics: Sequence[str], group: str) -> dict[str, int]:
        return await self._call("backlog", topics=list(topics), group=group)

    async def listen(self, topic: str, replay_s: float = 0.0, from_start: bool = False) -> Listener:
        ident = next(self._ids)
        messages = self._listeners[ident] = asyncio.Queue()
        await self._call("listen", topic=topic, replay_s=replay_s, from_start=from_start, id=ident)
        return _LocalListener(messages, lambda: self._call("close_listener", id=ident))

    async def open_request_queue(self, topics: Sequence[str], group: str, aging_s: float = 10.0) -> RequestQueue:
        ident = next(self._ids)
        queue = self._queues[ident] = _LocalRequestQueue(self, ident, aging_s)
        await self._call("open_request_queue", topics=list(topics), group=group, aging_s=aging_s, id=ident)
        return queue

    async def close_request_queue(self, ident: int) -> None:
        await self._call("close_request_queue", id=ident)

    def finished(self, delivery_id: int) -> None:
        if self._writer is not None and not self._writer.is_closing():
            _write(self._writer, _FINISHED, delivery_id, b"")


class _LocalListener(Listener):
    def __init__(self, messages: asyncio.Queue[BusMessage], close: Callable[[], Awaitable]) -> None:
        self._messages = messages
        self._close = close

    async def __aiter__(self) -> AsyncIterator[BusMessage]:
        while True:
            yield await self._messages.get()

    async def close(self) -> None:
        try:
            await self._close()
        except BusUnavailable:
            pass  # the serve process is closing too

    async def rebuild(self) -> None:
        """Nothing to rebuild: a local listener cannot get stuck."""


class _LocalRequestQueue(HandedRequests):
    """The requests the server sent, waiting to be offered; a Delivery's source is (topic, delivery id)."""

    def __init__(self, bus: LocalBus, ident: int, aging_s: float) -> None:
        super().__init__(aging_s)
        self._bus = bus
        self._ident = ident

    def finished(self, delivery: Delivery) -> None:
        self._bus.finished(delivery.source[1])

    async def close(self) -> None:
        try:
            await self._bus.close_request_queue(self._ident)
        except BusUnavailable:
            pass  # the serve process is closing too
