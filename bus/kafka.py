"""The bus on Apache Kafka, through aiokafka.

Latency matters more than throughput here, and so does the CPU an idle
consumer burns on a small machine. A fetch is a long poll that the broker
answers as soon as data arrives, so listeners (a fixed set of partitions)
wait up to `listen_fetch_max_wait_ms` (aiokafka's 500) at no cost in latency.
The request queue pauses and resumes partitions, and a partition resumed
joins only the next fetch: it waits at most `fetch_max_wait_ms` (a hundred
milliseconds). The producer sends at once. Request offsets are committed by
hand, per partition, up to the first request that is not finished yet, so
that the requests of a worker that dies are delivered again to another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import structlog
from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CommitFailedError,
    ConsumerStoppedError,
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    UnknownProducerId,
    UnknownTopicOrPartitionError,
)
from aiokafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from bus.base import Accept, Bus, BusUnavailable, Delivery, Listener, RequestQueue, UnknownTopic, offer
from bus.settings import KafkaSettings
from schemas.messages import BusMessage, GenerationRequest, decode, encode

log = structlog.get_logger("bus.kafka")

_TOPIC_ALREADY_EXISTS = 36
_TOPIC_VISIBLE_TIMEOUT_S = 10.0
_FETCH = 64  # requests read per poll at most: enough to compare priorities, few enough not to hoard


_RECORD_OVERHEAD = 64 * 1024  # a record's key, headers and batch framing around the message
# Errors after which an idempotent producer can no longer write to a partition: replaced (see _replace_producer).
_PRODUCER_BROKEN = (OutOfOrderSequenceNumber, UnknownProducerId, ProducerFenced)


async def check_bootstrap(servers: str, timeout_s: float = 5.0) -> None:
    """Raise BusUnavailable, naming each address and why, unless a Kafka broker answers at one of `servers`.

    A process checks this before it loads a model or listens: aiokafka would
    retry an address that refuses for as long as it is asked to, saying only
    that it cannot bootstrap.
    """
    addresses = [server.strip() for server in servers.split(",") if server.strip()]
    if not addresses:
        raise BusUnavailable("no Kafka address given (--kafka-bootstrap is empty)")

    async def reason(address: str) -> str | None:
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host or "localhost", int(port))
        except TimeoutError:
            return f"{address}: no answer in {timeout_s:g} s"
        except OSError as error:  # asyncio's words for a refusal name the address again; the system's do not
            return (
                f"{address}: {os.strerror(error.errno) if error.errno and error.errno > 0 else error.strerror or error}"
            )
        except ValueError as error:
            return f"{address}: {error}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None

    reasons = await asyncio.gather(*(reason(address) for address in addresses))
    if all(reasons):
        raise BusUnavailable(f"cannot reach Kafka at {'; '.join(reasons)}")
    client = AIOKafkaClient(bootstrap_servers=servers, request_timeout_ms=int(timeout_s * 1000))
    quiet = logging.getLogger("aiokafka")
    level, quiet.level = quiet.level, logging.CRITICAL  # its line would say less than ours
    try:
        await client.bootstrap()
    except KafkaError as error:
        raise BusUnavailable(f"no Kafka broker answers at {servers}: {error}") from None
    finally:
        quiet.setLevel(level)
        await client.close()


def _decode(record) -> BusMessage | None:
    try:
        return decode(record.value)
    except ValidationError as error:
        log.warning("undecodable_message", topic=record.topic, offset=record.offset, error=str(error)[:500])
        return None


class _KafkaListener(Listener):
    def __init__(self, consumer: AIOKafkaConsumer, reopen: Callable[[], Awaitable[AIOKafkaConsumer]]) -> None:
        self._consumer = consumer
        self._reopen = reopen  # a new consumer, assigned the same partitions
        self._next: dict[TopicPartition, int] = {}  # per partition: the offset after the last message handed out

    async def __aiter__(self) -> AsyncIterator[BusMessage]:
        while True:
            consumer = self._consumer
            try:
                batches = await consumer.getmany(timeout_ms=1000)
            except ConsumerStoppedError:
                if consumer is self._consumer:
                    raise
                continue  # rebuilt meanwhile
            for partition, records in batches.items():
                for record in records:
                    if consumer is not self._consumer:
                        break  # rebuilt meanwhile: the new consumer reads the rest again
                    self._next[partition] = record.offset + 1
                    message = _decode(record)
                    if message is not None:
                        yield message

    async def rebuild(self) -> None:
        try:
            consumer = await self._reopen()
        except (KafkaError, OSError, UnknownTopic) as error:
            raise BusUnavailable(f"cannot open a new consumer: {error!r}") from error
        for partition, offset in self._next.items():
            consumer.seek(partition, offset)
        old, self._consumer = self._consumer, consumer
        await old.stop()
        log.info("listener_rebuilt", partitions=len(consumer.assignment()))

    async def close(self) -> None:
        await self._consumer.stop()


class _OffsetTracker:
    """Per partition: which taken offsets are unfinished, and how far it was read."""

    def __init__(self) -> None:
        self.unfinished: set[int] = set()
        self.read_up_to = 0  # one past the highest offset taken

    def commit_position(self) -> int:
        return min(self.unfinished) if self.unfinished else self.read_up_to


# Per partition: the group's committed offset (None: none yet) and the partition's end offset.
LagProbe = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, tuple[int | None, int]]]]


class _KafkaRequestQueue(RequestQueue, ConsumerRebalanceListener):
    def __init__(
        self,
        open_consumer: Callable[[], AIOKafkaConsumer],
        topics: Sequence[str],
        group: str,
        aging_s: float,
        lag_probe: LagProbe,
        stuck_s: float,
    ) -> None:
        self._open_consumer = open_consumer
        self._topics = list(topics)
        self._group = group
        self._aging_s = aging_s
        self._lag_probe = lag_probe
        self._stuck_s = stuck_s
        self._consumer = open_consumer()
        self._offsets: dict[TopicPartition, _OffsetTracker] = {}
        self._to_commit: set[TopicPartition] = set()
        # Fetched but refused so far; their partitions are paused until they are taken.
        self._waiting: list[Delivery] = []
        self._fed_at = time.monotonic()  # when it last fetched something, or had nothing to fetch

    async def start(self) -> None:
        self._consumer.subscribe(self._topics, listener=self)
        await self._consumer.start()

    # -- ConsumerRebalanceListener: called by aiokafka around a rebalance

    async def on_partitions_revoked(self, revoked) -> None:
        if not revoked:  # aiokafka calls this before the first assignment too
            return
        await self._commit()
        for partition in revoked:
            self._offsets.pop(partition, None)
        # Their new owner reads them again from the last commit.
        self._waiting = [d for d in self._waiting if d.source[0] not in revoked]
        log.info("partitions_revoked", group=self._group, partitions=len(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        log.info("partitions_assigned", group=self._group, partitions=len(assigned))

    # -- RequestQueue

    async def take(self, accept: Accept, timeout_s: float) -> list[Delivery]:
        await self._commit()
        # Read on only where nothing is waiting: a refused request keeps its partition paused.
        holding = {d.source[0] for d in self._waiting}
        assigned = self._consumer.assignment()
        self._consumer.pause(*(assigned & holding))
        self._consumer.resume(*(assigned - holding))
        # Polling a paused consumer fetches nothing but keeps the member alive.
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=_FETCH)
        self._collect(batches)
        return offer(self._waiting, accept, self._aging_s)

    def _collect(self, batches) -> None:
        if batches:
            self._fed_at = time.monotonic()
        for partition, records in batches.items():
            tracker = self._offsets.setdefault(partition, _OffsetTracker())
            for record in records:
                tracker.read_up_to = max(tracker.read_up_to, record.offset + 1)
                self._to_commit.add(partition)
                message = _decode(record)
                if isinstance(message, GenerationRequest):
                    tracker.unfinished.add(record.offset)
                    self._waiting.append(Delivery(message, (partition, record.offset)))
                elif message is not None:
                    log.warning("not_a_request", topic=partition.topic, kind=message.kind)

    def offer_waiting(self, accept: Accept) -> list[Delivery]:
        return offer(self._waiting, accept, self._aging_s)

    def waiting(self) -> int:
        return len(self._waiting)

    def finished(self, delivery: Delivery) -> None:
        partition, offset = delivery.source
        tracker = self._offsets.get(partition)
        if tracker is not None:  # else the partition went to another member meanwhile
            tracker.unfinished.discard(offset)
            self._to_commit.add(partition)

    async def _commit(self) -> None:
        offsets = {
            p: OffsetAndMetadata(self._offsets[p].commit_position(), "") for p in self._to_commit if p in self._offsets
        }
        self._to_commit.clear()
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as error:
            # The partitions moved in a rebalance: their new owner starts from
            # the last commit that succeeded, so unfinished work is redone, not lost.
            log.warning("commit_failed", group=self._group, error=str(error))

    async def close(self) -> None:
        await self._commit()
        await self._consumer.stop()

    async def revive_if_stuck(self) -> bool:
        reading = list(self._consumer.assignment() - {d.source[0] for d in self._waiting})
        try:
            lag = await self._lag_probe(reading) if reading else {}
        except BusUnavailable:
            self._fed_at = time.monotonic()  # the broker is away: nobody fetches now, stuck or not
            raise
        behind = [p for p, (committed, end) in lag.items() if end > max(committed or 0, self._read_up_to(p))]
        if not behind:
            self._fed_at = time.monotonic()
            return False
        if time.monotonic() - self._fed_at < self._stuck_s:
            return False
        log.warning("request_consumer_stuck", group=self._group, partitions_behind=len(behind))
        await self._consumer.stop()  # leaves the group: whatever it had not finished is delivered again
        self._offsets.clear()
        self._to_commit.clear()
        self._waiting.clear()
        self._consumer = self._open_consumer()
        self._fed_at = time.monotonic()
        try:
            await self.start()
        except (KafkaError, OSError) as error:  # take() polls the new consumer, which connects when it can
            log.warning("request_consumer_not_started", group=self._group, error=repr(error))
        return True

    def _read_up_to(self, partition: TopicPartition) -> int:
        tracker = self._offsets.get(partition)
        return tracker.read_up_to if tracker is not None else 0


class KafkaBus(Bus):
    def __init__(self, settings: KafkaSettings, client_id: str) -> None:
        self._settings = settings
        self._client_id = client_id
        self.where = f"the Kafka broker at {settings.bootstrap_servers}"
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._offsets: AIOKafkaConsumer | None = None
        self._offsets_starting = asyncio.Lock()  # the workers of one process share the bus
        self.max_message_bytes = settings.max_message_bytes
        self._warned_unreplicated = False
        self._producer_lock = asyncio.Lock()
        self._stopping: set[asyncio.Task] = set()  # producers replaced, being stopped

    async def start(self) -> None:
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=self._settings.bootstrap_servers, client_id=f"{self._client_id}-admin"
        )
        try:
            await self._admin.start()
            self._producer = self._new_producer()
            await self._producer.start()
        except KafkaError as error:
            await self.close()
            raise BusUnavailable(f"no Kafka broker answers at {self._settings.bootstrap_servers}: {error}") from None
        log.info("kafka_connected", bootstrap=self._settings.bootstrap_servers)

    def _new_producer(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            bootstrap_servers=self._settings.bootstrap_servers,
            client_id=self._client_id,
            acks="all",  # a request acknowledged to the gateway survives a broker crash
            # A send retried after a leader change (its acknowledgement lost with the old leader) is
            # written once, not twice: the broker drops a batch whose producer id and sequence it has.
            enable_idempotence=True,
            linger_ms=0,
            request_timeout_ms=int(self._settings.publish_timeout_s * 1000),
            max_request_size=self._settings.max_message_bytes + _RECORD_OVERHEAD,
        )

    async def _replace_producer(self, broken: AIOKafkaProducer, error: BaseException) -> None:
        """A new producer (a new producer id, sequences from 0) in place of one that can no longer write.

        aiokafka's idempotent producer fails a batch that waited past its timeout while its partition had no
        leader (as when a lone broker restarts) after numbering it; every later batch to that partition is
        then out of sequence for the broker, for ever. Whoever published on the broken producer gets
        BusUnavailable, as for any failed publish.
        """
        async with self._producer_lock:
            if self._producer is not broken:
                return  # replaced meanwhile
            producer = self._new_producer()
            try:
                await producer.start()
            except (KafkaError, OSError) as start_error:  # the next failure tries again
                log.warning("kafka_producer_not_replaced", error=repr(error), start_error=repr(start_error))
                return
            self._producer = producer
        log.warning("kafka_producer_replaced", error=repr(error))
        stopping = asyncio.create_task(self._stop_producer(broken))
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        if self._offsets is not None:
            await self._offsets.stop()
        if self._producer is not None:
            await self._stop_producer(self._producer)
        await asyncio.gather(*self._stopping)
        if self._admin is not None:
            await self._admin.close()

    async def _stop_producer(self, producer: AIOKafkaProducer) -> None:
        """Stop the producer, dropping what the brokers do not take within publish_timeout_s.

        An idempotent producer retries a message until a broker takes it, and `stop()` waits for every
        message: with the brokers away it would wait for ever.
        """
        try:
            async with asyncio.timeout(self._settings.publish_timeout_s):
                await producer.flush()
        except TimeoutError:
            log.warning("kafka_unsent_messages_dropped")
            sender = producer._sender.sender_task  # stop() returns once the sender ends (or all is flushed)
            if sender is not None:
                sender.cancel()
        await producer.stop()

    def _topic_configs(self, compacted: bool) -> dict[str, str]:
        configs = {"max.message.bytes": str(self._settings.max_message_bytes + _RECORD_OVERHEAD)}
        if compacted:  # the latest message of each key is kept for ever, older ones cleaned away
            configs["cleanup.policy"] = "compact"
        if self._settings.replication_factor >= 3:
            # An acks=all write waits for two copies whatever the broker's default, and a topic keeps
            # taking writes with one replica down (two of three in sync).
            configs["min.insync.replicas"] = "2"
        return configs

    async def create_topics(self, partitions: Mapping[str, int], compacted: bool = False) -> None:
        assert self._admin is not None
        existing = set(await self._admin.list_topics())
        missing = [
            NewTopic(name, count, self._settings.replication_factor, topic_configs=self._topic_configs(compacted))
            for name, count in partitions.items()
            if name not in existing
        ]
        if not missing:
            return
        if self._settings.replication_factor == 1 and not self._warned_unreplicated:
            self._warned_unreplicated = True  # once per process: every worker and gateway creates topics
            log.warning(
                "kafka_unreplicated_topics",
                replication_factor=1,
                topics=[t.name for t in missing],
                consequence="a broker lost loses the requests and tokens its partitions hold; "
                "production runs --kafka-replication-factor 3 on three brokers or more",
            )
        response = await self._admin.create_topics(missing)
        for topic, code, *rest in response.topic_errors:
            if code not in (0, _TOPIC_ALREADY_EXISTS):  # a racing process may create it first
                raise BusUnavailable(f"cannot create topic {topic}: error {code} {rest}")
        await self._await_topics({t.name: t.num_partitions for t in missing})
        log.info("topics_created", topics=[t.name for t in missing])

    async def _await_topics(self, partitions: Mapping[str, int]) -> None:
        """Return once the broker's metadata shows every topic with its partitions."""
        assert self._admin is not None
        deadline = time.monotonic() + _TOPIC_VISIBLE_TIMEOUT_S
        while True:
            described = await self._admin.describe_topics(list(partitions))
            visible = {
                t["topic"] for t in described if t["error_code"] == 0 and len(t["partitions"]) == partitions[t["topic"]]
            }
            if visible >= set(partitions):
                return
            if time.monotonic() > deadline:
                raise BusUnavailable(f"topics not visible after creation: {sorted(set(partitions) - visible)}")
            await asyncio.sleep(0.05)

    async def delete_topics(self, topics: Sequence[str]) -> None:
        assert self._admin is not None
        await self._admin.delete_topics(list(topics))

    async def publish(self, topic: str, message: BusMessage, key: str | None = None) -> None:
        producer = self._producer
        assert producer is not None
        try:
            async with asyncio.timeout(self._settings.publish_timeout_s):
                await producer.send_and_wait(topic, encode(message), key=None if key is None else key.encode())
        except UnknownTopicOrPartitionError:
            raise UnknownTopic(topic) from None
        except (KafkaError, TimeoutError) as error:
            sender = producer._sender.sender_task
            if isinstance(error, _PRODUCER_BROKEN) or (sender is not None and sender.done()):
                await self._replace_producer(producer, error)
            if isinstance(error, TimeoutError):
                reason = f"did not take a message for {topic} within {self._settings.publish_timeout_s:g} s"
            else:
                reason = f"refused a message for {topic}: {error}"
            raise BusUnavailable(f"{self.where} {reason}") from error

    def _consumer(self, *topics: str, **overrides) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            *topics,
            bootstrap_servers=self._settings.bootstrap_servers,
            client_id=self._client_id,
            enable_auto_commit=False,
            max_partition_fetch_bytes=self._settings.max_message_bytes + _RECORD_OVERHEAD,
            **{"fetch_max_wait_ms": self._settings.fetch_max_wait_ms, **overrides},
        )

    async def read_to_end(self, topic: str) -> list[BusMessage]:
        """Every message the topic holds now (of a compacted topic: at least the latest of each key), from its
        beginning to its end as of the call; what does not decode is skipped. UnknownTopic if there is none."""
        consumer = await self._listening_consumer(topic, from_start=True)
        try:
            partitions = list(consumer.assignment())
            await consumer.seek_to_beginning(*partitions)
            ends = await consumer.end_offsets(partitions)
            messages: list[BusMessage] = []
            while [p for p in partitions if await consumer.position(p) < ends[p]]:
                for records in (await consumer.getmany(*partitions, timeout_ms=1000)).values():
                    for record in records:
                        with contextlib.suppress(ValidationError):
                            messages.append(decode(record.value))
            return messages
        finally:
            await consumer.stop()

    async def listen(self, topic: str, replay_s: float = 0.0, from_start: bool = False) -> Listener:
        consumer = await self._listening_consumer(topic)
        try:
            partitions = list(consumer.assignment())
            if from_start:
                await consumer.seek_to_beginning(*partitions)
            else:
                await consumer.seek_to_end(*partitions)
            if replay_s > 0 and not from_start:
                since_ms = int((time.time() - replay_s) * 1000)
                found = await consumer.offsets_for_times({p: since_ms for p in partitions})
                for partition, offset in found.items():
                    if offset is not None:
                        consumer.seek(partition, offset.offset)
            for partition in partitions:  # resolve the start now, not on the first read
                await consumer.position(partition)
        except BaseException:
            await consumer.stop()
            raise
        return _KafkaListener(consumer, lambda: self._listening_consumer(topic, from_start))

    async def _listening_consumer(self, topic: str, from_start: bool = False) -> AIOKafkaConsumer:
        """A started consumer of no group, assigned every partition of `topic`; where it has read nothing yet, it
        reads from the end (or, `from_start`, the beginning)."""
        consumer = self._consumer(
            group_id=None,
            auto_offset_reset="earliest" if from_start else "latest",
            fetch_max_wait_ms=self._settings.listen_fetch_max_wait_ms,
        )
        await consumer.start()
        try:
            consumer.assign(await self._partitions(topic))
        except BaseException:
            await consumer.stop()
            raise
        return consumer

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        assert self._admin is not None
        # A topic created a moment ago may not be in the metadata yet.
        deadline = time.monotonic() + _TOPIC_VISIBLE_TIMEOUT_S
        while True:
            [described] = await self._admin.describe_topics([topic])
            if described["error_code"] == 0 and described["partitions"]:
                return [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
            if time.monotonic() > deadline:
                raise UnknownTopic(topic)
            await asyncio.sleep(0.05)

    async def backlog(self, topics: Sequence[str], group: str) -> dict[str, int]:
        assert self._admin is not None
        try:
            partitions = [p for topic in topics for p in await self._partitions(topic)]
            committed = await self._admin.list_consumer_group_offsets(group)
            offsets = await self._offsets_reader()
            ends = await offsets.end_offsets(partitions)
            starts = await offsets.beginning_offsets(partitions)
        except (KafkaError, UnknownTopic) as error:
            raise BusUnavailable(f"cannot measure the backlog of {group}: {error!r}") from error
        backlog = dict.fromkeys(topics, 0)
        for partition in partitions:
            done = committed[partition].offset if partition in committed else starts[partition]
            backlog[partition.topic] += max(0, ends[partition] - done)
        return backlog

    async def _offsets_reader(self) -> AIOKafkaConsumer:
        """A consumer of no group, only to ask the broker for partitions' first and last offsets."""
        async with self._offsets_starting:
            if self._offsets is None:
                offsets = self._consumer()
                await offsets.start()
                self._offsets = offsets
        return self._offsets

    async def open_request_queue(self, topics: Sequence[str], group: str, aging_s: float = 10.0) -> RequestQueue:
        def open_consumer() -> AIOKafkaConsumer:
            return self._consumer(
                group_id=group,
                auto_offset_reset="earliest",  # a request published before any worker joined still counts
                session_timeout_ms=self._settings.session_timeout_ms,
                heartbeat_interval_ms=self._settings.heartbeat_interval_ms,
                max_poll_interval_ms=self._settings.max_poll_interval_ms,
            )

        async def lag(partitions: list[TopicPartition]) -> dict[TopicPartition, tuple[int | None, int]]:
            assert self._admin is not None
            try:
                committed = await self._admin.list_consumer_group_offsets(group, partitions=partitions)
                ends = await (await self._offsets_reader()).end_offsets(partitions)
            except KafkaError as error:
                raise BusUnavailable(f"cannot measure the lag of {group}: {error!r}") from error
            return {p: (committed[p].offset if p in committed else None, ends[p]) for p in partitions}

        queue = _KafkaRequestQueue(open_consumer, topics, group, aging_s, lag, self._settings.consumer_stuck_s)
        await queue.start()
        return queue
