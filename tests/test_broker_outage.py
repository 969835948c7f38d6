"""A broker that goes away and comes back: 503 within 2 s meanwhile, service again afterwards, no restarts.

This test needs a broker it may stop, so it starts its own from deploy/kafka/
(not the session's shared one, nor testcontainers').
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from tests.processes import REPO, free_port, on_kafka

pytestmark = pytest.mark.kafka

BROKER = str(REPO / "deploy" / "kafka" / "broker.sh")
MODEL = "tokenrelay-tiny"
BODY = {"text_input": "The following example", "parameters": {"max_new_tokens": 4}}


def _broker(command: str, port: int, directory) -> str:
    done = subprocess.run(
        [BROKER, command, "--port", str(port), "--dir", str(directory)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_while_the_broker_is_down_requests_get_503_in_2_s_and_service_resumes_when_it_is_back(tmp_path):
    port = free_port(pair=True)
    data = tmp_path / "kafka"
    bootstrap = _broker("start", port, data)
    try:
        with on_kafka(tmp_path, bootstrap) as (gateway, worker):
            url = gateway.url(f"/v2/models/{MODEL}/generate")
            assert httpx.post(url, json=BODY, timeout=60).status_code == 200

            _broker("stop", port, data)
            for _ in range(3):  # the first right after the stop, then with the broker long gone
                started = time.monotonic()
                response = httpx.post(url, json=BODY, timeout=30)
                assert time.monotonic() - started < 2.0
                assert response.status_code == 503, response.text
                assert response.json()["error_type"] == "Service Unavailable"
                time.sleep(1.0)

            _broker("start", port, data)
            back = time.monotonic()
            while True:
                response = httpx.post(url, json=BODY, timeout=30)
                if response.status_code == 200:
                    break
                assert response.status_code == 503, response.text
                assert time.monotonic() - back < 60, "no service a minute after the broker came back"
                time.sleep(0.5)
            assert response.json()["text_output"]
            assert gateway.process.popen.poll() is None and worker.popen.poll() is None
    finally:
        _broker("stop", port, data)
