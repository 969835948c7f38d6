"""The access log, request ids and the count of answers: every answer, refusals included, can be traced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from tests.test_api_errors import in_process_gateway


@pytest.fixture
def logged() -> Iterator[list[dict]]:
    """Every structlog entry while the test runs, with the context bound then (as telemetry/logs.py merges it)."""
    capture = structlog.testing.LogCapture()
    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        yield capture.entries
    finally:
        structlog.configure(processors=processors)


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    client, _ = in_process_gateway(tmp_path, api_keys=["key"], max_request_bytes=1024)
    client.headers["Authorization"] = "Bearer key"
    with client:
        yield client


def _access(entries: list[dict], event: str = "http_request") -> list[dict]:
    return [entry for entry in entries if entry["event"] == event]


def test_a_422_is_logged_with_its_status_route_and_request_id(client, logged):
    refused = client.post("/v2/models/tiny/generate", json={"text_input": "x", "parameters": {"max_new_tokens": 0}})
    assert refused.status_code == 422
    request_id = refused.headers["x-request-id"]
    assert len(request_id) == 32 and int(request_id, 16) >= 0  # one made up: uuid4's hex
    [line] = _access(logged)
    assert line["log_level"] == "warning"
    assert {k: line[k] for k in ("method", "route", "path", "status", "request_id", "bytes_sent")} == {
        "method": "POST",
        "route": "/v2/models/{model}/generate",
        "path": "/v2/models/tiny/generate",
        "status": 422,
        "request_id": request_id,
        "bytes_sent": len(refused.content),
    }
    assert line["client"] == "testclient:50000" and line["latency_ms"] >= 0


def test_the_clients_request_id_comes_back_and_is_logged(client, logged):
    answer = client.get("/health", headers={"X-Request-Id": "abc"})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "abc"
    [line] = _access(logged)
    assert (line["request_id"], line["status"], line["log_level"]) == ("abc", 200, "info")


@pytest.mark.parametrize("unusable", ["a b", "x" * 129, "é"])
def test_an_unusable_request_id_is_replaced(client, logged, unusable):
    answer = client.get("/health", headers={"X-Request-Id": unusable.encode()})
    assert answer.headers["x-request-id"] != unusable and len(answer.headers["x-request-id"]) == 32


def test_refusals_before_routing_and_errors_are_logged_at_their_level(client, logged):
    unauthorized = client.get("/v2", headers={"Authorization": "", "X-Request-Id": "no-key"})
    too_large = client.post("/generate", content=b"x" * 2048, headers={"X-Request-Id": "big"})
    unavailable = client.get("/v2/models/tiny/ready", headers={"X-Request-Id": "early"})
    unmatched = client.get("/nowhere", headers={"X-Request-Id": "lost"})
    assert [a.status_code for a in (unauthorized, too_large, unavailable, unmatched)] == [401, 413, 503, 404]
    assert all(a.headers["x-request-id"] for a in (unauthorized, too_large, unavailable, unmatched))
    lines = {line["request_id"]: line for line in _access(logged)}
    assert {rid: (lines[rid]["status"], lines[rid]["log_level"], lines[rid]["route"]) for rid in lines} == {
        "no-key": (401, "warning", "/v2"),
        "big": (413, "warning", "/generate"),
        "early": (503, "warning", "/v2/models/{model}/ready"),
        "lost": (404, "warning", "/nowhere"),
    }


def test_lines_logged_while_a_request_is_handled_carry_its_id(client, logged):
    def noisy() -> dict:
        structlog.get_logger("test").info("inside")
        return {}

    client.app.add_api_route("/noisy", noisy)
    client.get("/noisy", headers={"X-Request-Id": "traced"})
    [inside] = [entry for entry in logged if entry["event"] == "inside"]
    assert inside["request_id"] == "traced"


def test_an_unhandled_error_is_a_500_in_the_contracts_shape_with_the_id(client, logged):
    def broken() -> None:
        raise RuntimeError("bug")

    client.app.add_api_route("/broken", broken)
    quiet = TestClient(client.app, raise_server_exceptions=False, headers={"Authorization": "Bearer key"})
    answer = quiet.get("/broken", headers={"X-Request-Id": "oops"})
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "oops"
    assert answer.json() == {
        "error": "an internal error; the gateway's log tells more under request id oops",
        "error_type": "Internal Server Error",
    }
    [line] = _access(logged)
    assert (line["status"], line["log_level"], line["route"]) == (500, "error", "/broken")


def test_answers_are_counted_by_route_and_status(client):
    labels = {"route": "/v2/models/{model}/generate", "status": "422"}

    def count() -> float:
        return REGISTRY.get_sample_value("tokenrelay_gateway_http_responses_total", labels) or 0.0

    before = count()
    for _ in range(2):
        client.post("/v2/models/tiny/generate", json={})
    assert count() == before + 2
    client.get("/nowhere/at/all")
    assert REGISTRY.get_sample_value("tokenrelay_gateway_http_responses_total", {"route": "unmatched", "status": "404"})


def test_the_docs_assets_are_labelled_with_their_mounts_template(client, logged):
    def count(status: str) -> float:
        labels = {"route": "/docs-assets/{path}", "status": status}
        return REGISTRY.get_sample_value("tokenrelay_gateway_http_responses_total", labels) or 0.0

    before = count("200"), count("404")
    assert client.get("/docs-assets/favicon.png", headers={"X-Request-Id": "icon"}).status_code == 200
    assert client.get("/docs-assets/nothing.js", headers={"X-Request-Id": "none"}).status_code == 404
    assert (count("200"), count("404")) == (before[0] + 1, before[1] + 1)
    lines = {line["request_id"]: (line["route"], line["path"], line["status"]) for line in _access(logged)}
    assert lines == {
        "icon": ("/docs-assets/{path}", "/docs-assets/favicon.png", 200),
        "none": ("/docs-assets/{path}", "/docs-assets/nothing.js", 404),
    }


def test_a_websocket_stream_and_its_connection_are_logged_with_their_ids(client, logged):
    with client.websocket_connect("/ws", headers={"X-Request-Id": "conn"}) as socket:
        assert (b"x-request-id", b"conn") in socket.extra_headers  # on the handshake's answer
        socket.send_json({"op": "generate_stream", "id": "s1", "model": "tiny", "text_input": "x"})
        assert socket.receive_json()["data"]["error_type"] == "Service Unavailable"  # no worker yet
        assert socket.receive_json() == {"id": "s1", "done": True}
    [stream] = _access(logged, "websocket_stream")
    assert {k: stream[k] for k in ("op", "id", "request_id", "outcome", "status", "events", "log_level")} == {
        "op": "generate_stream",
        "id": "s1",
        "request_id": "conn/s1",
        "outcome": "error",
        "status": 503,
        "events": 0,
        "log_level": "warning",
    }
    [connection] = _access(logged, "websocket_connection")
    assert (connection["request_id"], connection["streams"], connection["close_code"]) == ("conn", 1, 1000)
