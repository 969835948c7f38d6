"""tokenrelay processes for end-to-end tests: start, wait until ready, read logs, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenrelay.topology import REPO, free_port
from tokenrelay.topology import wait_ready as wait_gateway_ready

TOKENRELAY = str(Path(sys.executable).parent / "tokenrelay")
# A worker's flags for the bundled model's stand-in: the real worker and engine around a model that is its step
# times alone (workers/simulated/), for tests of what carries tokens rather than of the tokens. It starts in a
# second without torch, and its steps wait rather than compute, so that a test's load costs no CPU.
SIMULATED = ("--simulate", "bundled-cpu", "--served-model-name", "tokenrelay-tiny")


class Process:
    def __init__(self, popen: subprocess.Popen, log_path: Path) -> None:
        self.popen = popen
        self.log_path = log_path

    def events(self) -> list[dict]:
        """The process's JSON log lines so far, parsed; a line it is still writing waits for the next call."""
        text = self.log_path.read_text()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]

    def raw_lines(self) -> list[str]:
        """What it wrote that is not a JSON event: a traceback, a warning, a print."""
        return [line for line in self.log_path.read_text().splitlines() if line and not line.startswith("{")]

    def events_named(self, name: str) -> list[dict]:
        return [e for e in self.events() if e.get("event") == name]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def spawn_tokenrelay(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Process:
    log = open(log_path, "w")
    popen = subprocess.Popen(
        [TOKENRELAY, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=REPO,
    )
    return Process(popen, log_path)


def wait_ready(base_url: str, model: str, processes: list[Process], timeout_s: float = 180) -> None:
    """Until the gateway says a worker serves `model`; fails early, with the logs, if a process died."""
    try:
        wait_gateway_ready(base_url, model, [p.popen for p in processes], timeout_s)
    except RuntimeError as error:
        tails = "\n\n".join(f"{p.log_path.name}:\n{p.log_tail()}" for p in processes)
        raise AssertionError(f"{error}\n{tails}") from None


class Served:
    """A `tokenrelay serve` process and where it listens."""

    def __init__(self, process: Process, base_url: str) -> None:
        self.process = process
        self.base_url = base_url

    def url(self, path: str) -> str:
        return self.base_url + path


@contextlib.contextmanager
def serving(log_dir: Path, *args: str, model: str = "tokenrelay-tiny", env: dict[str, str] | None = None):
    """`tokenrelay serve ARGS` on a free port, ready for `model`, stopped (cleanly) on exit."""
    port = free_port()
    process = spawn_tokenrelay(["serve", "--port", str(port), *args], log_dir / "serve.log", env)
    served = Served(process, f"http://127.0.0.1:{port}")
    try:
        wait_ready(served.base_url, model, [process])
        yield served
    finally:
        assert process.stop() == 0, process.log_tail()
        assert process.raw_lines() == [], process.log_tail()  # a clean stop: no traceback, no warning


@contextlib.contextmanager
def serving_https(
    log_dir: Path, args: list[str], context: ssl.SSLContext, headers: dict, model: str = "tokenrelay-tiny"
):
    """`tokenrelay serve ARGS` (its TLS among them) on a free port, ready for `model` as a client of `context`
    sees it, stopped on exit."""
    port = free_port()
    process = spawn_tokenrelay(["serve", "--port", str(port), *args], log_dir / f"serve-{port}.log")
    served = Served(process, f"https://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.popen.poll() is None and time.monotonic() < deadline, process.log_tail()
            try:
                ready = httpx.get(served.url(f"/v2/models/{model}/ready"), verify=context, headers=headers, timeout=2)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield served
    finally:
        assert process.stop() == 0, process.log_tail()


@contextlib.contextmanager
def on_kafka(
    log_dir: Path,
    bootstrap: str,
    worker_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    model: str = "tokenrelay-tiny",
):
    """A worker and a gateway on Kafka with topics of their own; yields (gateway, worker), both ready."""
    port = free_port()
    kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", f"t{uuid.uuid4().hex[:10]}"]
    worker = spawn_tokenrelay(["worker", *kafka, *worker_args], log_dir / "worker.log")
    gateway = spawn_tokenrelay(["gateway", "--port", str(port), *kafka, *gateway_args], log_dir / "gateway.log")
    served = Served(gateway, f"http://127.0.0.1:{port}")
    try:
        wait_ready(served.base_url, model, [worker, gateway])
        yield served, worker
    finally:
        for process in (gateway, worker):
            assert process.stop() == 0, process.log_tail()
            assert process.raw_lines() == [], process.log_tail()


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in Prometheus's text format (0 if absent), whatever the order of its labels."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def usage_of(bootstrap: str, topic_prefix: str) -> dict:
    """`tokenrelay usage --period all --json` of these topics: the usage records read, the requests they are of,
    and one row per tenant."""
    run = subprocess.run(
        [TOKENRELAY, "usage", "--kafka-bootstrap", bootstrap, "--topic-prefix", topic_prefix, "--period", "all"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
