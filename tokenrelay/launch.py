"""`serve`, `gateway`, `worker` and `simulate` as their flags describe them: their parts built, then run.

Imported once the command line is parsed. `serve` starts its engine process
first, so that the model loads while this process imports the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import uuid
from typing import TYPE_CHECKING

import prometheus_client
import structlog

from bus.base import Bus
from bus.inprocess import InProcessBus
from tokenrelay import lifecycle
from tokenrelay.engine_process import EngineProcess
from tokenrelay.worker_parts import build_worker, worker_id

if TYPE_CHECKING:
    from bus.kafka import KafkaBus

log = structlog.get_logger("tokenrelay")


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Run the command `args` describes until it is stopped; exit with its status. `argv`: its arguments."""
    children: list[EngineProcess] = []

    def stop_while_starting(signum: int, _) -> None:  # until lifecycle.run's own handlers replace this one
        for child in children:
            child.kill()
        log.info("stopped_while_starting", signal=signal.Signals(signum).name)
        lifecycle.exit_now(True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_while_starting)

    def run() -> bool:
        if args.command == "serve":
            bus: Bus = InProcessBus(args.max_message_bytes)
            engine = EngineProcess(bus, argv)
            engine.spawn()
            children.append(engine)
            from tokenrelay.http_server import http_server

            parts = (http_server(args, bus, engine.metrics), [engine])
        elif args.command == "gateway":
            _check_kafka(args)
            from tokenrelay.http_server import http_server

            bus = _kafka_bus(args, client_id=f"gateway-{args.gateway_id or uuid.uuid4().hex[:8]}")
            parts = (http_server(args, bus), [])
        else:
            _check_kafka(args)  # before a model loads for half a minute
            bus = _kafka_bus(args, client_id=f"worker-{args.worker_id or os.getpid()}")
            if args.command == "worker":
                workers = [build_worker(args, bus, worker_id(args))]
            else:  # simulate: one bus (producer, admin client) for every worker of the process
                args.simulate = args.simulate or "bundled-cpu"
                workers = [build_worker(args, bus, f"{worker_id(args)}-{i}") for i in range(args.workers)]
            parts = (None, workers)
        # A worker's /metrics answers once it has loaded its model and joined its group: a readiness probe.
        address = getattr(args, "metrics_address", "")
        started = functools.partial(_serve_metrics, address) if address else None
        return asyncio.run(lifecycle.run(bus, *parts, args.drain_timeout, started=started))

    lifecycle.exit_with(run)


def _check_kafka(args: argparse.Namespace) -> None:
    from bus.kafka import check_bootstrap

    log.info("connecting_to_kafka", bootstrap=args.kafka_bootstrap)
    asyncio.run(check_bootstrap(args.kafka_bootstrap))


def _kafka_bus(args: argparse.Namespace, client_id: str) -> KafkaBus:
    from bus.kafka import KafkaBus, KafkaSettings

    settings = KafkaSettings(
        bootstrap_servers=args.kafka_bootstrap,
        replication_factor=args.kafka_replication_factor,
        session_timeout_ms=args.kafka_session_timeout_ms,
        heartbeat_interval_ms=args.kafka_heartbeat_interval_ms,
        max_poll_interval_ms=args.kafka_max_poll_interval_ms,
        publish_timeout_s=args.kafka_publish_timeout,
        max_message_bytes=args.max_message_bytes,
    )
    return KafkaBus(settings, client_id=client_id)


def _serve_metrics(address: str) -> None:
    host, _, port = address.rpartition(":")
    prometheus_client.start_http_server(int(port), addr=host or "0.0.0.0")
    log.info("metrics_serving", url=f"http://{address}/metrics")
