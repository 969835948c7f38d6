"""The bus's flags: its messages' size, and Kafka's brokers, publishing and consumer group."""

from __future__ import annotations

from tokenrelay.flags.parser import Parser, option


def bus_options(parser: Parser) -> None:
    option(
        parser,
        "--max-message-bytes",
        type=int,
        default=16 * 2**20,
        help="largest message the bus carries, on Kafka (its producer, the topics created, the fetches) and in "
        "process alike: a request larger on the bus (its images count) is answered 413 before it is published",
    )


def kafka_options(parser: Parser) -> None:
    option(parser, "--kafka-bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    option(parser, "--kafka-replication-factor", type=int, default=1, help="replication of the topics created here")
    option(
        parser,
        "--kafka-publish-timeout",
        type=float,
        default=1.5,
        help="seconds a message may take to reach the broker; after that the publisher gives up "
        "(a gateway answers 503)",
    )


def kafka_group_options(parser: Parser) -> None:
    """A worker's membership of its consumer group: gateways join none."""
    option(
        parser,
        "--kafka-session-timeout-ms",
        type=int,
        default=6_000,
        help="how long the group waits for a silent member before its partitions move "
        "(a dead worker's unread requests wait this long)",
    )
    option(parser, "--kafka-heartbeat-interval-ms", type=int, default=1_000, help="group heartbeat period")
    option(
        parser,
        "--kafka-max-poll-interval-ms",
        type=int,
        default=60_000,
        help="longest pause between polls before the member is dropped",
    )
