"""The bus inside one process, for `tokenrelay serve`: asyncio queues, no broker.

It keeps the semantics the gateway and worker rely on: topics must be
created before use, listeners see what is published after they open (plus a
short replay), and each request of a queued topic goes to one taker. Nothing
survives the process, so acknowledging a request has nothing to do.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence

from bus.base import Bus, Delivery, Listener, RequestQueue, UnknownTopic
from schemas.messages import BusMessage, GenerationRequest

_REPLAY_WINDOW_S = 60.0


class _Topic:
    def __init__(self) -> None:
        self.listeners: set[asyncio.Queue[BusMessage]] = set()
        self.recent: deque[tuple[float, BusMessage]] = deque()  # for replay
        self.queue: _InProcessRequestQueue | None = None  # who takes its requests


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


class _InProcessRequestQueue(RequestQueue):
    def __init__(self, topics: Sequence[str]) -> None:
        self._waiting: dict[str, deque[GenerationRequest]] = {t: deque() for t in topics}
        self._arrived = asyncio.Event()

    def put(self, topic: str, request: GenerationRequest) -> None:
        self._waiting[topic].append(request)
        self._arrived.set()

    async def take(self, limit: int, timeout_s: float) -> list[Delivery]:
        if limit == 0:
            await asyncio.sleep(timeout_s)
            return []
        if not any(self._waiting.values()):
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout_s)
            except TimeoutError:
                return []
        taken: list[Delivery] = []
        for waiting in self._waiting.values():  # most urgent topic first
            while waiting and len(taken) < limit:
                taken.append(Delivery(waiting.popleft(), None))
        return taken

    def finished(self, delivery: Delivery) -> None:
        """Nothing to remember: an in-process queue dies with its process."""

    async def close(self) -> None:
        self._arrived.set()


class InProcessBus(Bus):
    def __init__(self) -> None:
        self._topics: dict[str, _Topic] = {}

    async def start(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        self._topics.clear()

    async def create_topics(self, partitions: Mapping[str, int]) -> None:
        for name in partitions:
            self._topics.setdefault(name, _Topic())

    async def delete_topics(self, topics: Sequence[str]) -> None:
        for name in topics:
            self._topics.pop(name, None)

    def _topic(self, name: str) -> _Topic:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(name) from None

    async def publish(self, topic: str, message: BusMessage) -> None:
        target = self._topic(topic)
        now = time.monotonic()
        target.recent.append((now, message))
        while target.recent and target.recent[0][0] < now - _REPLAY_WINDOW_S:
            target.recent.popleft()
        for listener in target.listeners:
            listener.put_nowait(message)
        if target.queue is not None and isinstance(message, GenerationRequest):
            target.queue.put(topic, message)

    async def listen(self, topic: str, replay_s: float = 0.0) -> Listener:
        target = self._topic(topic)
        since = time.monotonic() - replay_s
        replayed = [m for t, m in target.recent if t >= since] if replay_s > 0 else []
        return _InProcessListener(target, replayed)

    async def open_request_queue(self, topics: Sequence[str], group: str) -> RequestQueue:
        queue = _InProcessRequestQueue(topics)
        for name in topics:
            self._topic(name).queue = queue
        return queue
