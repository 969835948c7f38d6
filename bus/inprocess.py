"""The bus inside one process, for `tokenrelay serve`: asyncio queues, no broker.

It keeps the semantics the gateway and worker rely on: topics must be
created before use, listeners see what is published after they open (plus a
short replay), a compacted topic keeps the latest message of each key for
the listeners that read it from the start, and each request of a queued
topic goes to one taker. Nothing survives the process; acknowledging a
request only counts it out of the backlog.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Mapping, Sequence

from bus.base import Bus, Delivery, HandedRequests, Listener, RequestQueue, UnknownTopic
from schemas.messages import BusMessage, GenerationRequest

_REPLAY_WINDOW_S = 60.0


class _Topic:
    def __init__(self, compacted: bool) -> None:
        self.listeners: set[asyncio.Queue[BusMessage]] = set()
        self.recent: deque[tuple[float, BusMessage]] = deque()  # for replay
        # A compacted topic's: the latest message of each key (one without a key under a key of its own), in the
        # order they came, for listeners from the start.
        self.latest: dict[object, BusMessage] | None = {} if compacted else None
        self.queue: _InProcessRequestQueue | None = None  # who takes its requests

    def keep(self, message: BusMessage, key: str | None) -> None:
        if self.latest is not None:
            kept = object() if key is None else key
            self.latest.pop(kept, None)
            self.latest[kept] = message

    def held(self) -> list[BusMessage]:
        """Every message it still holds: a compacted topic's latest ones, another's of the replay window."""
        return list(self.latest.values()) if self.latest is not None else [m for _, m in self.recent]


class _InProcessListener(Listener):
    def __init__(self, topic: _Topic, replayed: list[BusMessage]) -> None:
        self._topic = topic
        self._queue: asyncio.Queue[BusMessage] = asyncio.Queue()
        for message in replayed:
            self._queue.put_nowait(message)
        topic.listeners.add(self._queue)

    async def __aiter__(self) -> AsyncIterator[BusMessage]:
        while True:
            yield await self._queue.get()

    async def close(self) -> None:
        self._topic.listeners.discard(self._queue)

    async def rebuild(self) -> None:
        """Nothing to rebuild: an in-process listener cannot get stuck."""


class _InProcessRequestQueue(HandedRequests):
    def __init__(self, aging_s: float) -> None:
        super().__init__(aging_s)
        self.unfinished: Counter[str] = Counter()  # per topic: taken or not, not finished yet

    def put(self, topic: str, request: GenerationRequest) -> None:
        self.unfinished[topic] += 1
        self.arrived(Delivery(request, topic))

    def finished(self, delivery: Delivery) -> None:
        self.unfinished[delivery.source] -= 1

    async def close(self) -> None:
        self._arrived.set()


class InProcessBus(Bus):
    def __init__(self, max_message_bytes: int | None = None) -> None:
        """`max_message_bytes`: what a Kafka deployment would carry, so that one process answers as it would."""
        self._topics: dict[str, _Topic] = {}
        self.max_message_bytes = max_message_bytes

    async def start(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        self._topics.clear()

    async def create_topics(self, partitions: Mapping[str, int], compacted: bool = False) -> None:
        for name in partitions:
            self._topics.setdefault(name, _Topic(compacted))

    async def delete_topics(self, topics: Sequence[str]) -> None:
        for name in topics:
            self._topics.pop(name, None)

    def _topic(self, name: str) -> _Topic:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(name) from None

    async def publish(self, topic: str, message: BusMessage, key: str | None = None) -> None:
        target = self._topic(topic)
        target.keep(message, key)
        now = time.monotonic()
        target.recent.append((now, message))
        while target.recent and target.recent[0][0] < now - _REPLAY_WINDOW_S:
            target.recent.popleft()
        for listener in target.listeners:
            listener.put_nowait(message)
        if target.queue is not None and isinstance(message, GenerationRequest):
            target.queue.put(topic, message)

    async def listen(self, topic: str, replay_s: float = 0.0, from_start: bool = False) -> Listener:
        target = self._topic(topic)
        since = time.monotonic() - replay_s
        if from_start:
            replayed = target.held()
        else:
            replayed = [m for t, m in target.recent if t >= since] if replay_s > 0 else []
        return _InProcessListener(target, replayed)

    async def backlog(self, topics: Sequence[str], group: str) -> dict[str, int]:
        queues = {name: self._topic(name).queue for name in topics}
        return {name: queue.unfinished[name] if queue else 0 for name, queue in queues.items()}

    async def open_request_queue(self, topics: Sequence[str], group: str, aging_s: float = 10.0) -> RequestQueue:
        queue = _InProcessRequestQueue(aging_s)
        for name in topics:
            self._topic(name).queue = queue
        return queue
