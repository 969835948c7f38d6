"""SIGTERM drains: new requests are refused with 503, those in flight end, then the process exits 0.

On Kafka the same holds per process (a rolling restart of gateways and
workers under load: tests/test_rolling_restart.py).
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.processes import free_port, serving, spawn_tokenrelay

MODEL = "tokenrelay-tiny"
LONG = {"text_input": "The following example", "parameters": {"max_new_tokens": 120, "seed": 7, "details": True}}


def _stream(url: str, counts: list[int], finished: list[str]) -> None:
    with httpx.stream("POST", url, json=LONG, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[len("data:") :])
                counts.append(event["details"]["generated_tokens"])
                if event["details"].get("finish_reason"):
                    finished.append(event["details"]["finish_reason"])


def test_serve_drains_on_sigterm(tmp_path):
    with serving(tmp_path) as served:
        url = served.url(f"/v2/models/{MODEL}/generate_stream")
        reference: list[int] = []
        _stream(url, reference, [])
        counts: list[int] = []
        finished: list[str] = []
        streaming = threading.Thread(target=_stream, args=(url, counts, finished))
        streaming.start()
        while len(counts) < 5:
            time.sleep(0.01)
        served.process.popen.terminate()
        refused = httpx.post(served.url(f"/v2/models/{MODEL}/generate"), json={"text_input": "x"}, timeout=10)
        ready = httpx.get(served.url("/v2/health/ready"), timeout=10)
        streaming.join(60)
        assert served.process.popen.wait(30) == 0, served.process.log_tail()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"], refused.text
    assert refused.headers["retry-after"] == "0"
    assert ready.status_code == 503
    assert counts == reference and finished == ["length"]  # every token, the stream ended as it would have
    [drained] = served.process.events_named("worker_drained")
    assert drained["handed_over"] == 0
    [gateway] = served.process.events_named("gateway_drained")
    assert gateway["cut_short"] == 0


def test_a_signal_while_serve_loads_its_model_stops_it_at_once(tmp_path):
    process = spawn_tokenrelay(["serve", "--port", str(free_port())], tmp_path / "serve.log")
    deadline = time.monotonic() + 60
    while not process.events_named("loading_model"):  # the engine process has begun to load
        assert time.monotonic() < deadline and process.popen.poll() is None, process.log_tail()
        time.sleep(0.1)
    assert process.stop(timeout_s=10) == 0, process.log_tail()
    assert process.raw_lines() == [], process.log_tail()
    assert process.events_named("stopped_while_starting") and not process.events_named("worker_started")
