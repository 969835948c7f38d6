"""A process's parts run until a signal, then drain and stop: the life of `serve`, `gateway`, `worker`, `simulate`.

The parts: a bus, an HTTP server (gateway) or none, and workers (in-process,
or `serve`'s engine process). A first signal drains them (at most the drain
timeout), a second one cuts that short; a part that ends by itself has failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog

from bus.base import BusUnavailable

if TYPE_CHECKING:
    from bus.base import Bus
    from gateway.service import GatewayService

log = structlog.get_logger("tokenrelay")

STOP_TIMEOUT_S = 15.0  # after a drain: stopping takes a second or two (an engine process's 10 s kill at most)


class CannotStart(Exception):
    """A flag names what cannot be had (no such model or profile): said in one line, without a traceback."""


class Part(Protocol):
    """A worker, or `serve`'s engine process seen as one."""

    async def start(self) -> None: ...
    async def run(self) -> None: ...
    async def drain(self, timeout_s: float) -> None: ...
    async def stop(self) -> None: ...


class HttpPart(Protocol):
    """The gateway's HTTP server (tokenrelay/http_server.py), which this module need not import."""

    gateway: GatewayService
    should_exit: bool

    async def serve(self) -> None: ...


def on_signals(stop_asked: Callable[[], None]) -> None:
    """SIGINT and SIGTERM ask this process to stop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_asked)


async def run(
    bus: Bus,
    server: HttpPart | None,
    workers: list[Part],
    drain_timeout_s: float,
    asks_to_stop: Callable[[Callable[[], None]], None] = on_signals,
    started: Callable[[], None] | None = None,
) -> bool:
    """Run the parts until asked to stop, or until one of them ends; then stop them all.

    `asks_to_stop(stop_asked)` arranges for `stop_asked()` to be called when the process should stop: a first
    call drains the parts (at most `drain_timeout_s`), a second one cuts that short. `started()` is called once
    the workers have started. Returns False when a part failed.
    """
    failed = False
    stopping, hurry = asyncio.Event(), asyncio.Event()

    def stop_asked() -> None:
        (hurry if stopping.is_set() else stopping).set()

    asks_to_stop(stop_asked)
    await bus.start()
    tasks = [asyncio.create_task(stopping.wait(), name="signal")]
    try:
        if not await _started(workers, tasks[0]):
            log.info("stopped_while_starting")
            return True
        if started is not None:
            started()
        tasks += [asyncio.create_task(worker.run(), name="worker") for worker in workers]
        if server is not None:
            tasks.append(asyncio.create_task(server.serve(), name="http"))
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.get_name() != "signal":  # a part that ends by itself has failed
                failed = True
                log.error("part_failed", part=task.get_name(), error=repr(task.exception()))
        if not failed:
            log.info("stopping", drain_timeout_s=drain_timeout_s)
            parts = [task for task in tasks if task.get_name() != "signal"]
            failed = not await _drain(server.gateway if server else None, workers, drain_timeout_s, hurry, parts)
    finally:
        if server is not None:
            server.should_exit = True
        # A task of its own, under a name of its own: a signal that comes now still finds the `stopping` event.
        stopped = asyncio.create_task(_stop(bus, workers, tasks))
        if not (await asyncio.wait({stopped}, timeout=STOP_TIMEOUT_S))[0]:
            # Exit anyway (the gateways fail over what a worker still held), and say what did not stop.
            stuck = {t.get_name(): repr(t.get_stack(limit=4)) for t in asyncio.all_tasks() if not t.done()}
            log.error("stop_stuck", seconds=STOP_TIMEOUT_S, tasks=stuck)
            exit_now(not failed)
        log.info("stopped")
    return not failed


async def _started(workers: list[Part], signalled: asyncio.Task) -> bool:
    """Start the workers (joining groups, or serve's engine loading its model); False if a signal came first."""
    starting = asyncio.ensure_future(asyncio.gather(*(worker.start() for worker in workers)))
    await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # raises what failed
        return True
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return False


async def _stop(bus: Bus, workers: list[Part], tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        if task.get_name() != "http":
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(worker.stop() for worker in workers))
    await bus.close()


async def _drain(
    gateway: GatewayService | None,
    workers: list[Part],
    timeout_s: float,
    hurry: asyncio.Event,
    parts: list[asyncio.Task],
) -> bool:
    """Refuse new requests, let those in flight end; cut short by a second signal. False if a part failed meanwhile."""
    if gateway is not None:
        gateway.start_draining()
    drains = [worker.drain(timeout_s) for worker in workers] + ([gateway.drained(timeout_s)] if gateway else [])
    draining = asyncio.ensure_future(asyncio.gather(*drains))
    hurried = asyncio.create_task(hurry.wait())
    try:
        done, _ = await asyncio.wait([draining, hurried, *parts], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
        draining.cancel()
        await asyncio.gather(draining, hurried, return_exceptions=True)
    failed = [task for task in done if task in parts]
    for task in failed:
        log.error("part_failed", part=task.get_name(), error=repr(task.exception()))
    if draining in done and draining.exception() is not None:
        log.error("drain_failed", error=repr(draining.exception()))
        return False
    return not failed


def exit_with(main: Callable[[], bool]) -> None:
    """Exit with the status of `main()` (which builds the parts and runs them), saying in one line why it could
    not start when a user can act on the reason."""
    try:
        ok = main()
    except BusUnavailable as error:
        log.error("kafka_unreachable", error=str(error))
        ok = False
    except CannotStart as error:
        log.error("cannot_start", error=str(error))
        ok = False
    except Exception:
        log.exception("failed")
        ok = False
    exit_now(ok)


def exit_now(ok: bool) -> None:
    """Exit now that all is stopped, said and logged: the interpreter's teardown (torch's) would take seconds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)
