"""`tokenrelay up`: several gateways and workers on one Kafka, from one command."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.processes import TOKENRELAY, free_port
from tokenrelay.topology import wait_ready

pytestmark = pytest.mark.kafka


def _started_workers(logs) -> set[str]:
    lines = [line for log in logs.glob("worker-*.log") for line in log.read_text().splitlines()]
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return {e["worker_id"] for e in events if e.get("event") == "worker_started"}


def test_up_starts_gateways_on_consecutive_ports_sharing_the_workers_and_stops_them_all(kafka_bootstrap, tmp_path):
    port = free_port(pair=True)
    logs = tmp_path / "logs"
    command = [
        TOKENRELAY,
        *("up", "--gateways", "2", "--workers", "2", "--port", str(port), "--log-dir", str(logs)),
        *("--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", f"up{uuid.uuid4().hex[:8]}"),
    ]
    with open(tmp_path / "up.log", "w") as output:
        up = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        gateways = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        for gateway in gateways:
            wait_ready(gateway, "tokenrelay-tiny", [up], timeout_s=240)
        body = {"text_input": "The following example", "parameters": {"max_new_tokens": 6}}
        answers = [
            httpx.post(f"{gateway}/v2/models/tokenrelay-tiny/generate", json=body, timeout=60) for gateway in gateways
        ]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["text_output"] == answers[1].json()["text_output"]  # greedy, whichever worker ran it
        assert sorted(p.name for p in logs.iterdir()) == [  # each named after the id it shows
            "gateway-0.log",
            "gateway-1.log",
            "worker-0.log",
            "worker-1.log",
        ]
        deadline = time.monotonic() + 120  # the gateways were ready with the first worker; the other may still load
        while _started_workers(logs) != {"worker-0", "worker-1"}:
            assert time.monotonic() < deadline, _started_workers(logs)
            time.sleep(0.5)
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0, (tmp_path / "up.log").read_text()[-3000:]
    for gateway in gateways:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{gateway}/health", timeout=2)


def test_up_keeps_its_logs_and_says_where_when_a_process_dies(kafka_bootstrap, tmp_path):
    command = [
        TOKENRELAY,
        *("up", "--gateways", "1", "--workers", "1", "--port", str(free_port())),
        *("--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", f"up{uuid.uuid4().hex[:8]}"),
        *("--worker-args", "--simulate no-such-profile"),  # the worker exits at once
    ]
    ended = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 1, ended.stderr[-3000:]
    lines = [json.loads(line) for line in ended.stderr.splitlines() if line.startswith("{")]
    died = [line for line in lines if line["event"] == "topology_process_died"]
    assert [(line["process"], line["exit_code"]) for line in died] == [("worker-0", 1)]
    assert "no-such-profile" in died[0]["last_line"]
    stopping = [line for line in lines if line["event"] == "topology_stopping"]
    assert stopping[0]["reason"] == "a process died"
    logs = Path(stopping[0]["logs_kept"])
    try:
        assert sorted(p.name for p in logs.iterdir()) == ["gateway-0.log", "worker-0.log"]
        assert died[0]["log"] == str(logs / "worker-0.log")
    finally:
        shutil.rmtree(logs)


def test_up_says_what_it_does_while_its_broker_starts_and_stops_in_json_lines_only():
    """Without --kafka-bootstrap, `up` starts a local broker (Maven's jars, then the JVM: seconds of silence once);
    every line it writes says what it does as JSON, the broker's start and stop too."""
    command = [
        TOKENRELAY,
        *("up", "--gateways", "1", "--workers", "1", "--port", str(free_port())),
        *("--worker-args", "--simulate no-such-profile"),  # the worker exits at once: up stops everything
    ]
    ended = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert ended.returncode == 1, ended.stderr[-3000:]
    lines = [json.loads(line) for line in ended.stderr.splitlines()]  # JSON only: nothing printed beside the logger
    events = [line["event"] for line in lines]
    assert events[0] == "kafka_broker_starting", events  # the first thing said, before the broker's seconds
    assert events.index("kafka_broker_started") < events.index("topology_starting"), events
    started = lines[events.index("kafka_broker_started")]
    assert started["bootstrap"] == f"127.0.0.1:{lines[0]['port']}" and started["seconds"] > 0
    assert events[-1] == "kafka_broker_stopped", events
    [said] = lines[-1]["said"]
    assert re.fullmatch(rf"stopped the Kafka broker of {re.escape(lines[0]['data'])} \(pid \d+\)", said), said
