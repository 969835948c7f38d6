"""Fixtures: a real Kafka broker, and tokenrelay processes on loopback.

The broker is, in this order: the one named by KAFKA_BOOTSTRAP_SERVERS;
testcontainers' Kafka when a Docker engine answers; else a local broker from
deploy/kafka/ (Maven Central's jars, no Docker), started once per session, or
once for all the workers of a parallel run (`pytest -n 2`, as `make test`
runs: pytest-xdist).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import REPO, Process, free_port, serving, spawn_tokenrelay

# The Triton attention kernels run on CPU tensors under Triton's interpreter, which must be chosen before
# triton is first imported; on a GPU (TOKENRELAY_TEST_DEVICE=cuda) they run compiled.
if os.environ.get("TOKENRELAY_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


BROKER = str(REPO / "deploy" / "kafka" / "broker.sh")


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _start_broker(data_dir: Path) -> str:
    """A local broker from deploy/kafka/ with its data in `data_dir`; its bootstrap address."""
    port = free_port(pair=True)  # the broker's port, and the controller's after it
    started = subprocess.run(
        [BROKER, "start", "--port", str(port), "--dir", str(data_dir)], capture_output=True, text=True, timeout=300
    )
    if started.returncode != 0:
        pytest.fail(f"the local Kafka broker did not start:\n{started.stderr}")
    return started.stdout.strip()


def _stop_broker(data_dir: Path) -> None:
    subprocess.run([BROKER, "stop", "--dir", str(data_dir)], timeout=60)


_SHARED_BROKER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n`), one local broker for every worker: started here, in the controller, before
    the workers are, which find it in KAFKA_BOOTSTRAP_SERVERS. Each test's topics are its own."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or _docker_answers():
        return
    data_dir = Path(tempfile.mkdtemp(prefix="tokenrelay-tests-kafka-"))
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = _start_broker(data_dir)
    config.stash[_SHARED_BROKER] = data_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    data_dir = config.stash.get(_SHARED_BROKER, None)
    if data_dir is not None:
        _stop_broker(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


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
    try:
        yield _start_broker(data_dir)
    finally:
        _stop_broker(data_dir)


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
def compat_client(compat_server):
    """The official OpenAI SDK's client of `compat_server`, as users make one."""
    import openai

    return openai.OpenAI(base_url=compat_server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory):
    """One `tokenrelay serve` for the OpenAI and TGI client tests (two names for the bundled model)."""
    with serving(tmp_path_factory.mktemp("compat"), "--served-model-name", "tokenrelay-tiny", "gpt-tiny") as served:
        yield served
