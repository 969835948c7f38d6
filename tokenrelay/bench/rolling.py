"""`tokenrelay bench rolling`: a rolling restart under steady load, as every deployment update is; nothing may be lost.

Starts `--gateways` gateways and `--workers` workers on one Kafka (a local
broker from deploy/kafka/ unless `--kafka-bootstrap`), learns each kind of
stream's reference as `bench chaos` does, then keeps `--concurrency` seeded
streams going while each worker in turn is replaced: a new one starts, and
once it serves the old one gets SIGTERM (the order of a Deployment's rolling
update); the next waits until the old one has exited. Then each gateway
likewise. A client whose gateway refuses (503
while it drains, or a refused connection once it is gone) sends the request
to another gateway. The first worker gets a second SIGTERM a moment after
the first: its drain is cut short, so its streams are handed over to the
other workers mid-way (`--no-hurry`: every drain runs its course).

Counts each stream as `bench chaos` does (completed, lost, duplicated,
missing, different, hung), the requests retried on another gateway, and each
stopped process's exit code and seconds from SIGTERM to exit. Exits 1
unless every stream completed as its reference and every process exited 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import httpx

from tokenrelay.bench.chaos import FAILURES, OUTCOMES, Refused, judge, kinds, received, stream
from tokenrelay.bench.help import HelpFormatter
from tokenrelay.topology import free_port, local_broker, spawn, wait_ready

_HURRY_AFTER_S = 0.05  # the second SIGTERM, after the first, of the worker whose drain is cut short
_JUST_ADMITTED_S = 0.1
_RETRY_PAUSE_S = 0.05


class Fleet:
    """Gateways and workers on one Kafka, replaced one at a time as a Deployment's rolling update does.

    Each replacement starts before its old process gets SIGTERM, and serves
    first (Kubernetes' default maxSurge, with no pod unavailable). Spares
    started with the fleet (`spares`) stand ready for it: a shorter run, the
    same drains.
    """

    def __init__(self, kafka: list[str], logs: Path, drain_timeout_s: float, worker_args: list[str]) -> None:
        self._kafka = [*kafka, "--drain-timeout", str(drain_timeout_s)]
        self._worker_args = worker_args
        self._logs = logs
        self._started = 0
        self.workers: dict[Path, subprocess.Popen] = {}  # log -> process, the ones serving
        self.spare_workers: dict[Path, subprocess.Popen] = {}
        self.gateways: dict[str, subprocess.Popen] = {}  # base URL -> process, spares included
        self.urls: list[str] = []  # where clients send requests
        self.spare_urls: list[str] = []

    def start_worker(self) -> Path:
        """A new worker; where it logs."""
        self._started += 1
        log = self._logs / f"worker-{self._started}.log"
        self.spare_workers[log] = spawn(["worker", *self._kafka, *self._worker_args, "--worker-id", log.stem], log)
        return log

    def start_gateway(self) -> str:
        """A new gateway; its base URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.gateways[url] = spawn(["gateway", *self._kafka, "--port", str(port)], self._logs / f"gateway-{port}.log")
        self.spare_urls.append(url)
        return url

    async def replacement_worker(self) -> None:
        """A spare (or a new) worker joins the serving ones, once it has joined its group."""
        log = next(iter(self.spare_workers), None) or self.start_worker()
        process = self.spare_workers.pop(log)
        while b'"worker_started"' not in log.read_bytes():
            if process.poll() is not None:
                raise RuntimeError(f"a replacement worker exited while starting: see {log}")
            await asyncio.sleep(0.1)
        self.workers[log] = process

    async def replacement_gateway(self, model: str) -> None:
        """A spare (or a new) gateway joins the ones clients use, once a worker serves through it."""
        url = self.spare_urls[0] if self.spare_urls else self.start_gateway()
        await asyncio.to_thread(wait_ready, url, model, [self.gateways[url]])
        self.spare_urls.remove(url)
        self.urls.append(url)

    def processes(self) -> list[subprocess.Popen]:
        return [*self.workers.values(), *self.spare_workers.values(), *self.gateways.values()]

    def stop(self) -> None:
        for process in self.processes():
            process.terminate()
        for process in self.processes():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


async def _stopped(process: subprocess.Popen, hurry: bool) -> dict:
    """SIGTERM (and a second one at once if `hurry`); its exit code and the seconds it took."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    if hurry:
        await asyncio.sleep(_HURRY_AFTER_S)
        process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.wait)
    return {"exit_code": code, "seconds": round(time.monotonic() - sent, 2)}


def _events(log: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if f'"event": "{name}"' in line]


async def _busy(log: Path, running: int) -> None:
    """Until the worker logging to `log` runs at least `running` requests, the last one admitted just now: a
    drain cut short _HURRY_AFTER_S later still finds it running, however near their end the others are."""
    while True:
        admitted = _events(log, "request_admitted")
        if len(admitted) - len(_events(log, "request_finished")) >= running:
            if time.time() - datetime.fromisoformat(admitted[-1]["timestamp"]).timestamp() < _JUST_ADMITTED_S:
                return
        await asyncio.sleep(0.02)


async def run_rolling(
    fleet: Fleet,
    *,
    concurrency: int,
    hang_after_s: float,
    hurry_first: bool = True,
    model: str = "tokenrelay-tiny",
    seed: int = 0,
) -> dict:
    """Replace every process of a ready `fleet` under load; the counts (see the module's docstring)."""
    request_kinds = kinds(16, seed)
    tally: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    stopped: list[dict] = []
    rolled = asyncio.Event()

    def endpoint(n: int) -> str:
        return f"{fleet.urls[n % len(fleet.urls)]}/v2/models/{model}/generate_stream"

    async with httpx.AsyncClient(timeout=httpx.Timeout(hang_after_s, connect=10)) as client:
        references = await asyncio.gather(*(stream(client, endpoint(i), k) for i, k in enumerate(request_kinds)))

        async def one(n: int) -> str:
            kind = n % len(request_kinds)
            while True:
                try:
                    got = await stream(client, endpoint(n), request_kinds[kind])
                    tally["streams_ended"] += 1
                    tally["output_tokens"] += received(got)
                    return judge(got, references[kind])
                except Refused:  # before anything was sent to a worker
                    tally["retried"] += 1
                    n += 1
                    await asyncio.sleep(_RETRY_PAUSE_S)

        async def client_loop(n: int) -> None:
            while not rolled.is_set():
                try:
                    tally[await asyncio.wait_for(one(n), hang_after_s)] += 1
                except TimeoutError:
                    tally["hung"] += 1
                except (RuntimeError, httpx.HTTPError) as error:
                    tally["lost"] += 1
                    errors[f"{type(error).__name__}: {error}"[:120]] += 1
                n += concurrency

        async def roll() -> None:
            try:
                await replace_all()
            finally:
                rolled.set()

        async def replace_all() -> None:
            for index, (log, old) in enumerate(list(fleet.workers.items())):
                await fleet.replacement_worker()
                hurry = hurry_first and index == 0
                if hurry:
                    await _busy(log, 2)  # so that there is something to hand over
                stopped.append({"process": log.stem, **await _stopped(old, hurry)})
                stopped[-1]["handed_over"] = _events(log, "worker_drained")[0]["handed_over"]
                del fleet.workers[log]
            for url in list(fleet.urls):
                await fleet.replacement_gateway(model)
                stopped.append({"process": f"gateway {url}", **await _stopped(fleet.gateways.pop(url), hurry=False)})
                fleet.urls.remove(url)
            await asyncio.sleep(1.0)  # some load on the new fleet alone

        await asyncio.gather(roll(), *(client_loop(i) for i in range(concurrency)))
    return {
        "requests": sum(tally[o] for o in OUTCOMES),
        **{outcome: tally[outcome] for outcome in OUTCOMES},
        "retried_elsewhere": tally["retried"],
        # Every stream that ended as the client saw it, the references included, and the tokens they brought.
        "streams_ended": len(references) + tally["streams_ended"],
        "output_tokens": sum(received(r) for r in references) + tally["output_tokens"],
        "stopped": stopped,
        "errors": dict(errors),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench rolling", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="streams open at once")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="every process's --drain-timeout")
    parser.add_argument("--hang-after", type=float, default=60.0, help="seconds after which a stream counts as hung")
    parser.add_argument("--no-hurry", action="store_true", help="let the first worker's drain run its course too")
    parser.add_argument(
        "--spares", action="store_true", help="start every replacement with the fleet: a shorter run, the same drains"
    )
    parser.add_argument("--kafka-bootstrap", default="", help="empty: a local broker")
    parser.add_argument(
        "--worker-args",
        default="",
        help="more flags for every worker, one string (e.g. '--simulate bundled-cpu --served-model-name "
        "tokenrelay-tiny': a fleet without weights, the real workers and engines around simulated models)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the streams' requests")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenrelay-rolling-") as scratch, ExitStack() as stack:
        logs = Path(scratch)
        bootstrap = args.kafka_bootstrap or stack.enter_context(local_broker(logs / "kafka"))
        kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", f"rolling{uuid.uuid4().hex[:8]}"]
        fleet = start_fleet(
            kafka, logs, args.gateways, args.workers, args.drain_timeout, args.spares, args.worker_args.split()
        )
        stack.callback(fleet.stop)
        result = asyncio.run(
            run_rolling(
                fleet, concurrency=args.concurrency, hang_after_s=args.hang_after, hurry_first=not args.no_hurry
            )
        )
    print(
        f"{result['requests']} requests, {result['retried_elsewhere']} retried on another gateway: "
        + ", ".join(f"{outcome} {result[outcome]}" for outcome in OUTCOMES),
        flush=True,
    )
    for process in result["stopped"]:
        print(
            f"{process['process']}: exit {process['exit_code']} after {process['seconds']} s"
            + (f", {process['handed_over']} handed over" if "handed_over" in process else ""),
            flush=True,
        )
    if args.json:
        print(json.dumps(result), flush=True)
    clean = all(p["exit_code"] == 0 for p in result["stopped"])
    raise SystemExit(0 if clean and all(result[o] == 0 for o in FAILURES) else 1)


def start_fleet(
    kafka: list[str],
    logs: Path,
    gateways: int,
    workers: int,
    drain_timeout_s: float,
    spares: bool = False,
    worker_args: list[str] = (),
) -> Fleet:
    """`workers` workers and `gateways` gateways, each gateway ready; with `spares`, as many again standing by."""
    fleet = Fleet(kafka, logs, drain_timeout_s, list(worker_args))
    for _ in range(workers * (1 + spares)):
        fleet.start_worker()
    for _ in range(gateways * (1 + spares)):
        fleet.start_gateway()
    fleet.urls, fleet.spare_urls = fleet.spare_urls[:gateways], fleet.spare_urls[gateways:]
    fleet.workers = dict(list(fleet.spare_workers.items())[:workers])
    fleet.spare_workers = dict(list(fleet.spare_workers.items())[workers:])
    for url in [*fleet.urls, *fleet.spare_urls]:
        wait_ready(url, "tokenrelay-tiny", fleet.processes())
    return fleet
