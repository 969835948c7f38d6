"""Fixtures: a real Kafka broker, and tokenrelay processes on loopback.

The broker is, in this order: the one named by KAFKA_BOOTSTRAP_SERVERS;
testcontainers' Kafka when a Docker engine answers; else a local broker from
deploy/kafka/ (Maven Central's jars, no Docker), started once per session.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import REPO, Process, free_port, serving, spawn_tokenrelay

# The Triton attention kernels run on CPU tensors under Triton's interpreter, which must be chosen before
# triton is first imported; on a GPU (TOKENRELAY_TEST_DEVICE=cuda) they run compiled.
if os.environ.get("TOKENRELAY_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    if _docker_answers():
        from testcontainers.community.kafka import KafkaContainer

        # The same group settings as deploy/kafka/broker.sh gives the local broker.
        container = (
            KafkaContainer()
            .with_kraft()
            .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
            .with_env("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", "1000")
        )
        with container:
            yield container.get_bootstrap_server()
        return
    data_dir = tmp_path_factory.mktemp("kafka")
    port = free_port(pair=True)  # the broker's port, and the controller's after it
    broker = str(REPO / "deploy" / "kafka" / "broker.sh")
    started = subprocess.run(
        [broker, "start", "--port", str(port), "--dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if started.returncode != 0:
        pytest.fail(f"the local Kafka broker did not start:\n{started.stderr}")
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run([broker, "stop", "--dir", str(data_dir)], timeout=60)


@pytest.fixture
def topic_prefix() -> str:
    """Topics of their own for each test, on a broker shared by the session."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start `tokenrelay ...` processes that are stopped when the test ends."""
    started: list[Process] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Process:
        process = spawn_tokenrelay(list(args), tmp_path / f"{args[0]}-{len(started)}.log", env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory):
    """One `tokenrelay serve` for the OpenAI and TGI client tests (two names for the bundled model)."""
    with serving(tmp_path_factory.mktemp("compat"), "--served-model-name", "tokenrelay-tiny", "gpt-tiny") as served:
        yield served
