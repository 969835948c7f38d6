"""`serve`, `gateway`, `worker` and `simulate` as their settings describe them: their parts built, then run.

Imported once the command line is parsed. `serve` starts its engine process
first, so that the model loads while this process imports the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import uuid
from dataclasses import replace

import prometheus_client
import structlog

from bus.base import Bus
from bus.factory import open_bus
from bus.settings import KafkaSettings
from tokenrelay import lifecycle
from tokenrelay.engine_process import EngineProcess
from tokenrelay.listening import bound_sockets
from tokenrelay.settings import Settings, settings_of
from tokenrelay.worker_parts import build_worker

log = structlog.get_logger("tokenrelay")


def launch(args: argparse.Namespace) -> None:
    """Run the command `args` describes until it is stopped; exit with its status."""
    children: list[EngineProcess] = []

    def stop_while_starting(signum: int, _) -> None:  # until lifecycle.run's own handlers replace this one
        for child in children:
            child.kill()
        log.info("stopped_while_starting", signal=signal.Signals(signum).name)
        lifecycle.exit_now(True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_while_starting)
    lifecycle.exit_with(lambda: run(settings_of(args), children))


def run(settings: Settings, children: list[EngineProcess]) -> bool:
    """Build the parts of `settings`' command and run them until stopped; False when one failed. An engine
    process spawned is added to `children` at once, so that a signal while starting can kill it."""
    sockets = bound_sockets(settings.server) if settings.server else None  # a port in use: said before all else
    bus = _bus(settings)
    if settings.command == "serve":
        engine = EngineProcess(bus, settings.engine_process())
        engine.spawn()
        children.append(engine)
        from tokenrelay.http_server import http_server

        parts = (http_server(settings.server, settings.gateway, bus, engine.metrics, sockets), [engine])
    elif settings.command == "gateway":
        from tokenrelay.http_server import http_server

        parts = (http_server(settings.server, settings.gateway, bus, sockets=sockets), [])
    else:
        ids = [settings.worker.worker_id]
        if settings.command == "simulate":  # one bus (producer, admin client) for every worker of the process
            ids = [f"{settings.worker.worker_id}-{i}" for i in range(settings.workers)]
        workers = [
            build_worker(settings.model, settings.engine, replace(settings.worker, worker_id=worker_id), bus)
            for worker_id in ids
        ]
        parts = (None, workers)
    # A worker's /metrics answers once it has loaded its model and joined its group: a readiness probe.
    started = functools.partial(_serve_metrics, settings.metrics_address) if settings.metrics_address else None
    return asyncio.run(lifecycle.run(bus, *parts, settings.drain_timeout_s, started=started))


def _bus(settings: Settings) -> Bus:
    """The command's bus; a Kafka broker is checked first, before a model loads for half a minute."""
    if not isinstance(settings.bus, KafkaSettings):
        return open_bus(settings.bus, client_id="serve")
    from bus.kafka import check_bootstrap

    log.info("connecting_to_kafka", bootstrap=settings.bus.bootstrap_servers)
    asyncio.run(check_bootstrap(settings.bus.bootstrap_servers))
    if settings.command == "gateway":
        return open_bus(settings.bus, client_id=f"gateway-{settings.gateway.gateway_id or uuid.uuid4().hex[:8]}")
    return open_bus(settings.bus, client_id=f"worker-{settings.worker.worker_id}")


def _serve_metrics(address: str) -> None:
    host, _, port = address.rpartition(":")
    prometheus_client.start_http_server(int(port), addr=host or "0.0.0.0")
    log.info("metrics_serving", url=f"http://{address}/metrics")
