"""The message bus, as gateways and workers see it.

Two kinds of reading:
- a *listener* sees every message of a topic from now on (optionally the last
  few seconds too): replies for a gateway, control messages for everyone; or
  from the topic's beginning, for a compacted topic whose latest message of
  each key is a state (the LoRA adapters loaded at run time);
- a *request queue* shares the request topics of a model among the workers of
  a group: each request goes to one worker, which acknowledges it when the
  request is finished, so that a worker that dies leaves its unfinished
  requests to be delivered again.

Implementations: `bus.kafka.KafkaBus` (the real thing) and
`bus.inprocess.InProcessBus` (one process, no broker).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from schemas.messages import BusMessage, GenerationRequest

log = structlog.get_logger(__name__)


class BusUnavailable(Exception):
    """The bus could not take or deliver a message in time."""


class UnknownTopic(Exception):
    """A message was published to a topic nobody created."""


@dataclass(frozen=True)
class Delivery:
    """A request taken from a request queue, and where it came from."""

    request: GenerationRequest
    source: Any  # opaque to callers: what the queue needs to acknowledge it


class Listener(ABC):
    """Every message of one topic from the moment the listener was opened."""

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[BusMessage]: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def rebuild(self) -> None:
        """Replace a consumer that stopped delivering with a new one that goes on where it stopped."""


# Whether the caller starts a request now (or drops it at once: expired, cancelled).
Accept = Callable[[Delivery], bool]


class RequestQueue(ABC):
    """The requests of a set of topics, shared by the members of a group."""

    @abstractmethod
    async def take(self, accept: Accept, timeout_s: float) -> list[Delivery]:
        """The waiting requests that `accept` takes, offered most urgent first.

        Urgency is the priority aged by the time waited since arrival (see
        `GenerationRequest.urgency`). A refused request stays waiting,
        unacknowledged, and is offered again next time; nothing more is
        fetched from its partition meanwhile, so a busy member does not hoard.
        Waits at most `timeout_s` for something to offer. Call it often even
        when nothing can be accepted: that is how a Kafka member shows it is
        alive.
        """

    @abstractmethod
    def offer_waiting(self, accept: Accept) -> list[Delivery]:
        """Offer again what was taken from the topics and refused, without fetching more (a slot just freed)."""

    @abstractmethod
    def waiting(self) -> int:
        """Requests taken from the topics and refused so far: they wait for this member."""

    @abstractmethod
    def finished(self, delivery: Delivery) -> None:
        """The request is done (answered, failed, or dropped): never deliver it again."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def revive_if_stuck(self) -> bool:
        """Rebuild the consumer if it has stopped fetching requests that wait for it; True if it did.

        Call it every few seconds. Requests taken and not finished are
        delivered again after a rebuild (to this member or another).
        """


# Timeouts here and everywhere are `asyncio.timeout`, never `asyncio.wait_for`: on Python 3.11, wait_for
# swallows a cancellation that arrives as the awaited thing completes (gh-86296, fixed in 3.12), and a loop
# around it then never ends; a drain or a stop that cancels that loop waited for ever.


class HandedRequests(RequestQueue):
    """A request queue whose requests are handed to it in this process (`arrived`), as a list offered most
    urgent first: the in-process bus's queue, and a child process's queue on it (bus/local.py)."""

    def __init__(self, aging_s: float) -> None:
        self._aging_s = aging_s
        self._waiting: list[Delivery] = []
        self._arrived = asyncio.Event()

    def arrived(self, delivery: Delivery) -> None:
        self._waiting.append(delivery)
        self._arrived.set()

    async def take(self, accept: Accept, timeout_s: float) -> list[Delivery]:
        taken = offer(self._waiting, accept, self._aging_s)
        if taken:
            return taken
        self._arrived.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._arrived.wait()
        except TimeoutError:
            return []
        return offer(self._waiting, accept, self._aging_s)

    def offer_waiting(self, accept: Accept) -> list[Delivery]:
        return offer(self._waiting, accept, self._aging_s)

    def waiting(self) -> int:
        return len(self._waiting)

    async def revive_if_stuck(self) -> bool:
        return False  # nothing between the queue and where its requests come from to get stuck


def offer(waiting: list[Delivery], accept: Accept, aging_s: float) -> list[Delivery]:
    """Offer `waiting` to `accept`, most urgent first; return the taken ones (and remove them from `waiting`)."""
    now = time.time()
    waiting.sort(key=lambda d: d.request.urgency(now, aging_s))
    taken = [d for d in waiting if accept(d)]
    if taken:
        taken_ids = {id(d) for d in taken}
        waiting[:] = [d for d in waiting if id(d) not in taken_ids]
    return taken


class Bus(ABC):
    max_message_bytes: int | None = None  # the largest message it carries (encoded); None: no limit
    where = "the in-process bus"  # what it is, in an error that blames it (Kafka: its brokers' addresses)

    async def publish_or_log(self, topic: str, message: BusMessage, event: str, key: str | None = None) -> bool:
        """Publish a message whose loss the protocol tolerates (a heartbeat, a goodbye, events nobody
        may read); if the bus refuses it, log `event` and return False instead of raising."""
        try:
            await self.publish(topic, message, key=key)
        except (BusUnavailable, UnknownTopic) as error:
            log.warning(event, topic=topic, error=str(error))
            return False
        return True

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def create_topics(self, partitions: Mapping[str, int], compacted: bool = False) -> None:
        """Create the topics that do not exist yet, with these partition counts.

        `compacted`: the broker keeps only the latest message of each key (Kafka's cleanup.policy=compact), for
        a topic of states read from its beginning; one without a key is never compacted away.
        """

    @abstractmethod
    async def delete_topics(self, topics: Sequence[str]) -> None: ...

    @abstractmethod
    async def publish(self, topic: str, message: BusMessage, key: str | None = None) -> None:
        """Deliver a message; raises BusUnavailable or UnknownTopic.

        `key`: what a compacted topic keeps the latest message of (see create_topics).
        """

    @abstractmethod
    async def listen(self, topic: str, replay_s: float = 0.0, from_start: bool = False) -> Listener:
        """Open a listener; once this returns, no later message of the topic is missed.

        `replay_s` > 0 also delivers the messages of the last `replay_s` seconds; `from_start`, every message
        the topic still holds (of a compacted topic: at least the latest of each key).
        """

    @abstractmethod
    async def backlog(self, topics: Sequence[str], group: str) -> dict[str, int]:
        """Per topic: requests published that `group` has not acknowledged yet (waiting or running).

        Kafka calls it the group's consumer lag. Raises BusUnavailable.
        """

    @abstractmethod
    async def open_request_queue(self, topics: Sequence[str], group: str, aging_s: float = 10.0) -> RequestQueue:
        """Join `group` as a consumer of `topics`; waiting `aging_s` makes a request one priority more urgent."""
