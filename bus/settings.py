"""Which bus a process is on: Kafka and its settings, or the in-process bus.

A light module: the settings are built (tokenrelay/settings.py) and sent to
serve's engine process before anything imports aiokafka. bus/factory.py
builds a bus from them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InProcessSettings:
    """The in-process bus of `tokenrelay serve`."""

    # What a Kafka deployment would carry, so that one process answers as it would (413 past it).
    max_message_bytes: int = 16 * 2**20


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str
    replication_factor: int = 1
    fetch_max_wait_ms: int = 100  # request queues
    listen_fetch_max_wait_ms: int = 500  # listeners
    # Group membership of workers. The model runs off the event loop, so
    # heartbeats flow during long steps; these only bound how fast a dead
    # worker is noticed.
    session_timeout_ms: int = 6_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 60_000
    # Past this the publisher stops waiting: a gateway answers 503 at once. The producer is idempotent,
    # so it never expires a message: it still delivers it once the partition has a leader again (the
    # receivers drop what nobody waits for), and drops it only when the bus closes.
    publish_timeout_s: float = 1.5
    # The largest message carried: the producer, every topic this process creates (max.message.bytes) and the
    # consumers' fetches are set to it. Kafka's default is 1 MB; a request may carry a 4 MB text_input.
    max_message_bytes: int = 16 * 2**20
    # A request queue's consumer that fetched nothing this long while its partitions
    # have requests it has not read is stuck (it happens after a broker restart): rebuilt.
    consumer_stuck_s: float = 30.0
