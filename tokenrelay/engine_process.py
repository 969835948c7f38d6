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
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog

from bus.base import Bus
from bus.local import LocalBusServer

log = structlog.get_logger(__name__)

_STOP_WAIT_S = 10.0  # after a drain's time, or after the ask to stop at once: then it is killed


class EngineProcess:
    """Start, drain and stop the engine process; the same steps `_run` takes with an in-process worker."""

    def __init__(self, bus: Bus, main: Callable[[list[str], str], None], argv: list[str]) -> None:
        """`main(argv, socket_path)` runs in the new process: a worker on the bus at that socket."""
        self._directory = tempfile.TemporaryDirectory(prefix="tokenrelay-serve-")
        self._socket = str(Path(self._directory.name) / "bus.sock")
        self._server = LocalBusServer(bus, self._socket)
        self._process = multiprocessing.get_context("spawn").Process(
            target=main, args=(argv, self._socket), name="tokenrelay-engine"
        )
        self._ended = asyncio.Event()
        self._drained = False  # sent the SIGTERM that drains it

    async def start(self) -> None:
        """Once its worker has connected, which it does when its model has loaded."""
        await self._server.start()
        self._process.start()
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_exit)
        connected = asyncio.create_task(self._server.connected.wait())
        ended = asyncio.create_task(self._ended.wait())
        await asyncio.wait([connected, ended], return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        ended.cancel()
        if self._ended.is_set():
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})")
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


def ignore_signals() -> None:
    """In the engine process: Ctrl-C (and a SIGTERM to the process group) is for the serve process, which asks
    this one to drain when its own drain begins."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
