"""`tokenrelay serve`'s engine, in a process of its own, seen from the serve process as a worker.

The serve process runs the gateway and the in-process bus; the engine
process runs a worker on that bus through a Unix socket (bus/local.py). The
model's steps then never wait for the interpreter lock that the gateway's
HTTP work holds. Signals sent to both (Ctrl-C, or SIGTERM to the process
group) are acted on by the serve process only: it asks the engine process
over the socket to drain (a second signal: to stop at once). If either
process dies, the other ends too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from bus.base import Bus
from bus.local import LocalBus, LocalBusServer
from tokenrelay.lifecycle import CannotStart

if TYPE_CHECKING:
    from tokenrelay.settings import Settings

log = structlog.get_logger(__name__)

_STOP_WAIT_S = 10.0  # after a drain's time, or after the ask to stop at once: then it is killed


class EngineProcess:
    """Start, drain and stop the engine process; the same steps lifecycle.run takes with an in-process worker."""

    def __init__(self, bus: Bus, settings: Settings) -> None:
        """The new process runs `engine_main(settings, socket_path)`: a worker on the bus at that socket."""
        self._directory = tempfile.TemporaryDirectory(prefix="tokenrelay-serve-")
        self._socket = str(Path(self._directory.name) / "bus.sock")
        self._server = LocalBusServer(bus, self._socket)
        self._process = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(settings, self._socket), name="tokenrelay-engine"
        )
        self._ended = asyncio.Event()
        self._drained = False  # asked to drain

    def spawn(self) -> None:
        """Start the process now, before any event loop: its model loads while this process builds the rest."""
        self._process.start()

    def kill(self) -> None:
        """At once, without a word to it: this process stops before it has started."""
        if self._process.pid is not None:
            self._process.kill()

    async def start(self) -> None:
        """Once its worker has connected, which it does when its model has loaded."""
        if self._process.pid is None:
            self.spawn()
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_exit)
        await self._server.start()
        connected = asyncio.create_task(self._server.connected.wait())
        ended = asyncio.create_task(self._ended.wait())
        await asyncio.wait([connected, ended], return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        ended.cancel()
        if self._ended.is_set():
            code = self._process.exitcode
            raise CannotStart(f"the engine process exited while starting (exit code {code}): its line above says why")
        log.info("engine_process_started", pid=self._process.pid)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join()  # it has ended: this only reads its exit code
        self._ended.set()

    async def run(self) -> None:
        """Until the engine process ends by itself, which is a failure; or until cancelled."""
        await self._ended.wait()
        if self._drained:  # told to end: drain() says how it went
            await asyncio.Future()
        raise RuntimeError(f"the engine process exited (exit code {self._process.exitcode})")

    async def drain(self, timeout_s: float) -> None:
        self._drained = True
        await self._server.ask_to_stop()
        try:
            async with asyncio.timeout(timeout_s + _STOP_WAIT_S):
                await self._ended.wait()
        except TimeoutError:
            log.warning("engine_process_not_drained", pid=self._process.pid)
            return
        if self._process.exitcode != 0:
            raise RuntimeError(f"the engine process failed while draining (exit code {self._process.exitcode})")

    async def stop(self) -> None:
        if self._process.pid is None:  # never started
            await self._server.close()
            return
        if not self._server.connected.is_set() and not self._ended.is_set():  # loading its model: nothing to drain
            self.kill()
            self._on_exit()
        if not self._ended.is_set() and not self._drained:
            await self._server.ask_to_stop()  # the first ask starts a drain...
        if not self._ended.is_set():
            await self._server.ask_to_stop()  # ...the second one stops it at once
            try:
                async with asyncio.timeout(_STOP_WAIT_S):
                    await self._ended.wait()
            except TimeoutError:
                self._process.kill()
                log.warning("engine_process_killed", pid=self._process.pid)
        await self._ended.wait()
        await self._server.close()
        self._directory.cleanup()

    async def metrics(self) -> bytes:
        """The engine process's Prometheus text (its worker's families)."""
        return await self._server.metrics()


def engine_main(settings: Settings, socket_path: str) -> None:
    """The engine process of `tokenrelay serve`: its worker, on the serve process's bus at `socket_path`."""
    # Ctrl-C (and a SIGTERM to the process group) is for the serve process, which asks this one to drain
    # when its own drain begins.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import prometheus_client

    from telemetry import logs
    from tokenrelay import lifecycle
    from tokenrelay.worker_parts import build_worker

    logs.configure(settings.log_level, process="engine", log_format=settings.log_format)
    for collector in (
        prometheus_client.PROCESS_COLLECTOR,
        prometheus_client.PLATFORM_COLLECTOR,
        prometheus_client.GC_COLLECTOR,
    ):
        prometheus_client.REGISTRY.unregister(collector)  # the serve process's own report these
    bus = LocalBus(
        socket_path, prometheus_client.generate_latest, settings.bus.max_message_bytes, on_lost=lambda: os._exit(1)
    )

    def asks_to_stop(stop_asked) -> None:  # the serve process asks, over the socket
        bus.stop_asked = stop_asked

    def run() -> bool:
        worker = build_worker(settings.model, settings.engine, settings.worker, bus)
        return asyncio.run(lifecycle.run(bus, None, [worker], settings.drain_timeout_s, asks_to_stop=asks_to_stop))

    lifecycle.exit_with(run)
