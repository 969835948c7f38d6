"""The message bus, as gateways and workers see it.

Two kinds of reading:
- a *listener* sees every message of a topic from now on (optionally the last
  few seconds too): replies for a gateway, control messages for everyone;
- a *request queue* shares the request topics of a model among the workers of
  a group: each request goes to one worker, which acknowledges it when the
  request is finished, so that a worker that dies leaves its unfinished
  requests to be delivered again.

Implementations: `bus.kafka.KafkaBus` (the real thing) and
`bus.inprocess.InProcessBus` (one process, no broker).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.messages import BusMessage, GenerationRequest


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


class RequestQueue(ABC):
    """The requests of a set of topics, shared by the members of a group."""

    @abstractmethod
    async def take(self, limit: int, timeout_s: float) -> list[Delivery]:
        """Up to `limit` requests, most urgent topic first, waiting at most `timeout_s`.

        Call it often even with `limit` 0: that is how a Kafka member shows it
        is alive while its engine is full.
        """

    @abstractmethod
    def finished(self, delivery: Delivery) -> None:
        """The request is done (answered, failed, or dropped): never deliver it again."""

    @abstractmethod
    async def close(self) -> None: ...


class Bus(ABC):
    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def create_topics(self, partitions: Mapping[str, int]) -> None:
        """Create the topics that do not exist yet, with these partition counts."""

    @abstractmethod
    async def delete_topics(self, topics: Sequence[str]) -> None: ...

    @abstractmethod
    async def publish(self, topic: str, message: BusMessage) -> None:
        """Deliver a message; raises BusUnavailable or UnknownTopic."""

    @abstractmethod
    async def listen(self, topic: str, replay_s: float = 0.0) -> Listener:
        """Open a listener; once this returns, no later message of the topic is missed.

        `replay_s` > 0 also delivers the messages of the last `replay_s` seconds.
        """

    @abstractmethod
    async def open_request_queue(self, topics: Sequence[str], group: str) -> RequestQueue:
        """Join `group` as a consumer of `topics` (given most urgent first)."""
