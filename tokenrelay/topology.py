"""Topologies on one machine: a local Kafka broker and `tokenrelay` processes, started and stopped together.

`tokenrelay up` starts gateways and workers on one Kafka to try them out;
`tokenrelay bench serve --topology` uses the same pieces for each topology
it measures.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import structlog

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parent.parent
BROKER = REPO / "deploy" / "kafka" / "broker.sh"
JARS = REPO / "deploy" / "kafka" / "lib" / ".fetched"  # broker.sh's mark of the jars fetched


def free_port(pair: bool = False, span: int = 1) -> int:
    """A loopback port nobody listens on (and the one after it too, with `pair`; the `span` - 1 after it,
    with `span`: a local Kafka cluster's nodes take two each)."""
    span = max(span, 2 if pair else 1)
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + span > 65536:
            continue
        with ExitStack() as held:
            try:
                for following in range(port + 1, port + span):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", following))
            except OSError:
                continue
        return port


def wait_ready(base: str, model: str | None, processes: list[subprocess.Popen], timeout_s: float = 300) -> None:
    """Return once the gateway at `base` says a worker serves `model` (None: any model).

    RuntimeError if one of `processes` exits first, or after `timeout_s`.
    """
    path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = [p.args for p in processes if p.poll() is not None]
        if exited:
            raise RuntimeError(f"exited while starting: {exited}")
        try:
            if httpx.get(base + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base}{path} did not answer 200 within {timeout_s} s")


def spawn(command: list[str], log_path: Path) -> subprocess.Popen:
    """`tokenrelay COMMAND...` in the background, its output appended to `log_path`."""
    with open(log_path, "a") as log:
        return subprocess.Popen([sys.executable, "-m", "tokenrelay.cli", *command], stdout=log, stderr=log, cwd=REPO)


@contextmanager
def tokenrelay_processes(
    commands: list[list[str]], logs: Path, names: list[str] | None = None
) -> Iterator[list[subprocess.Popen]]:
    """`tokenrelay COMMAND...` for each command, logging to `logs`; terminated (SIGTERM, then kill) on exit.

    Each logs to `logs/<name>.log`, its name from `names` (default: its command and index).
    """
    names = names or [f"{command[0]}-{index}" for index, command in enumerate(commands)]
    processes: list[subprocess.Popen] = []
    try:
        for name, command in zip(names, commands, strict=True):
            processes.append(spawn(command, logs / f"{name}.log"))
        yield processes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def replication_factor(brokers: int) -> int:
    """The replication of topics on a cluster of `brokers`: three copies where there are three brokers."""
    return min(brokers, 3)


@contextmanager
def local_broker(directory: Path, brokers: int = 1) -> Iterator[str]:
    """A Kafka broker from deploy/kafka/ on free loopback ports, its data in `directory`; yields its address.

    With `brokers` 3 or more, a replicated cluster (deploy/kafka/broker.sh --brokers); yields its bootstrap list.
    """
    port = free_port(span=2 * brokers)  # each node's client port, and its controller's after it
    command = [str(BROKER), "start", "--port", str(port), "--dir", str(directory)]
    if brokers > 1:
        command += ["--brokers", str(brokers)]
    # Seconds of silence otherwise: Maven fetches Kafka's jars on first use, then the JVMs start.
    log.info("kafka_broker_starting", brokers=brokers, port=port, data=str(directory), fetching_jars=not JARS.exists())
    began = time.monotonic()
    started = subprocess.run(command, capture_output=True, text=True)
    if started.returncode != 0:
        raise RuntimeError(f"the local Kafka broker did not start: {started.stderr[-2000:]}")
    bootstrap = started.stdout.strip()
    log.info("kafka_broker_started", bootstrap=bootstrap, seconds=round(time.monotonic() - began, 1))
    try:
        yield bootstrap
    finally:
        stopped = subprocess.run([str(BROKER), "stop", "--dir", str(directory)], capture_output=True, text=True)
        log.info("kafka_broker_stopped", data=str(directory), said=stopped.stderr.splitlines())


@contextmanager
def bench_site(prefix: str, log_dir: str, kafka_bootstrap: str) -> Iterator[tuple[Path, str]]:
    """Where a bench's processes log (`log_dir`, or a temporary directory named by `prefix`) and the Kafka they
    use (`kafka_bootstrap`, or a local broker with its data there): yields both."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        logs = Path(log_dir or scratch)
        logs.mkdir(parents=True, exist_ok=True)
        if kafka_bootstrap:
            yield logs, kafka_bootstrap
            return
        with local_broker(logs / "kafka") as bootstrap:
            yield logs, bootstrap


def up(args: argparse.Namespace) -> int:
    """`tokenrelay up`: run the topology until SIGINT/SIGTERM (0) or until one of its processes dies (1).

    Each process logs to `<log dir>/<its id>.log`. Without --log-dir they go to a temporary directory, removed
    after a clean stop and kept (and named) when a process died.
    """
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    if args.kafka_brokers == 2 or args.kafka_brokers < 1:
        # Two controllers cannot elect a leader when one is gone: no better than one broker.
        log.error("topology_bad_brokers", brokers=args.kafka_brokers, allowed="1, or 3 or more")
        return 2
    logs = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tokenrelay-up-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    status = _up(args, logs, stopping)
    if status == 0 and not args.log_dir:
        shutil.rmtree(logs, ignore_errors=True)
    return status


def _up(args: argparse.Namespace, logs: Path, stopping: threading.Event) -> int:
    with tempfile.TemporaryDirectory(prefix="tokenrelay-up-") as scratch, ExitStack() as stack:
        bootstrap = args.kafka_bootstrap or stack.enter_context(
            local_broker(Path(scratch) / "kafka", args.kafka_brokers)
        )
        kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", args.topic_prefix]
        if args.kafka_brokers > 1:
            kafka += ["--kafka-replication-factor", str(replication_factor(args.kafka_brokers))]
        urls = [f"http://{args.host}:{args.port + i}" for i in range(args.gateways)]
        names = [f"worker-{i}" for i in range(args.workers)] + [f"gateway-{i}" for i in range(args.gateways)]
        worker_args, gateway_args = shlex.split(args.worker_args), shlex.split(args.gateway_args)
        commands = [["worker", *kafka, "--worker-id", name, *worker_args] for name in names[: args.workers]]
        commands += [
            ["gateway", *kafka, "--host", args.host, "--port", str(args.port + i), "--gateway-id", name, *gateway_args]
            for i, name in enumerate(names[args.workers :])
        ]
        processes = stack.enter_context(tokenrelay_processes(commands, logs, names))
        log.info("topology_starting", kafka=bootstrap, logs={name: str(logs / f"{name}.log") for name in names})
        try:
            for url in urls:
                wait_ready(url.replace("0.0.0.0", "127.0.0.1"), None, processes)
        except RuntimeError as error:  # a process died (each is named below), or a gateway is still not ready
            log.warning("topology_not_ready", error=str(error))
        else:
            log.info("topology_up", gateways=urls, workers=args.workers, kafka_brokers=args.kafka_brokers)
        while not stopping.wait(0.5):
            died = {name: process for name, process in zip(names, processes, strict=True) if process.poll() is not None}
            if died:
                for name, process in died.items():
                    log.error(
                        "topology_process_died",
                        process=name,
                        exit_code=process.returncode,
                        last_line=_last_line(logs / f"{name}.log"),
                        log=str(logs / f"{name}.log"),
                    )
                log.error("topology_stopping", reason="a process died", logs_kept=str(logs))
                return 1
        log.info("topology_stopping", reason="signal")
    return 0


def _last_line(path: Path) -> str:
    """The last line a process logged: usually why it stopped."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return lines[-1][-2000:] if lines else ""
