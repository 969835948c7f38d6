"""Errors a user can act on: each says what is wrong and what would be right.

One gateway in this process on an in-process bus, no worker: the directory
is fed heartbeats directly where a test needs a model announced.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from bus.inprocess import InProcessBus
from gateway.app import create_app
from gateway.media.loader import MediaLoader
from gateway.service import GatewayService
from gateway.settings import GatewaySettings, MediaPolicy
from tests.test_gateway_state import _heartbeat

WS_OPS = "'generate_stream', 'infer', 'tgi', 'completions', 'chat.completions', 'cancel'"


def in_process_gateway(
    tmp_path: Path, settings: GatewaySettings | None = None, **options
) -> tuple[TestClient, GatewayService]:
    """A gateway app on an in-process bus, with no worker; started and stopped by the client's context.

    `settings`: the gateway's (default: GatewaySettings()); `options`: create_app's (api_keys, max_request_bytes)."""
    service = GatewayService(InProcessBus(), settings or GatewaySettings())
    media = MediaLoader(MediaPolicy(media_dir=tmp_path))
    app = create_app(service, media, **{"max_request_bytes": 1024 * 1024, **options})
    return TestClient(app), service


@pytest.fixture
def gateway(tmp_path) -> Iterator[tuple[TestClient, GatewayService]]:
    client, service = in_process_gateway(tmp_path)
    with client:
        yield client, service


@pytest.fixture
def client(gateway) -> TestClient:
    """A gateway that a worker has told it serves `tiny`, also called `llama_65b`."""
    client, service = gateway
    service.directory.observe(_heartbeat("w1", ["tiny", "llama_65b"]))
    return client


@pytest.fixture
def strict_client(tmp_path) -> Iterator[TestClient]:
    """The same, with --reject-unknown-fields: a field no document lists is refused, as before 2026-12-05."""
    client, service = in_process_gateway(tmp_path, GatewaySettings(reject_unknown_fields=True))
    with client:
        service.directory.observe(_heartbeat("w1", ["tiny"]))
        yield client


def test_a_method_not_served_is_a_405_that_names_the_allowed_ones(client):
    refused = client.delete("/health")
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
    assert refused.json() == {
        "error": "DELETE is not allowed on /health; allowed: GET, HEAD",
        "error_type": "Method Not Allowed",
    }
    openai = client.get("/v1/completions")
    assert openai.status_code == 405 and openai.headers["allow"] == "POST"
    assert openai.json()["error"] == {
        "message": "GET is not allowed on /v1/completions; allowed: POST",
        "type": "invalid_request_error",
        "param": None,
        "code": "Method Not Allowed",
    }


@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/metrics", "/v1/models", "/v2/models/tiny/ready"])
def test_head_is_answered_wherever_get_is(client, path):
    got, head = client.get(path), client.head(path)
    assert (head.status_code, head.content) == (200, b"") and got.status_code == 200
    assert head.headers.get("content-type") == got.headers.get("content-type")


def test_head_tells_a_probe_what_get_would(gateway):
    client, _ = gateway  # no worker yet
    assert client.head("/v2/health/ready").status_code == 503
    assert client.head("/v2/models/tiny/ready").status_code == 503


def test_a_trailing_slash_is_a_404_naming_the_path_without_it(client):
    answer = client.get("/health/", follow_redirects=False)
    assert answer.status_code == 404
    assert answer.json() == {
        "error": "nothing is served at /health/; the path is /health, without the trailing slash",
        "error_type": "NotFoundError",
    }
    openai = client.post("/v1/completions/", json={}, follow_redirects=False)
    assert openai.status_code == 404
    assert openai.json()["error"]["message"] == (
        "nothing is served at /v1/completions/; the path is /v1/completions, without the trailing slash"
    )
    nowhere = client.get("/nowhere/")
    assert nowhere.json()["error"] == "nothing is served at /nowhere/"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v2/models/nope/ready", None),
        ("GET", "/v2/models/nope", None),
        ("POST", "/v2/models/nope/generate", {"text_input": "x"}),
    ],
)
def test_an_unknown_model_is_a_404_that_lists_the_served_names(client, method, path, body):
    answer = client.request(method, path, json=body)
    assert answer.status_code == 404
    assert answer.json() == {
        "error": "model nope is not served here; served: llama_65b, tiny",
        "error_type": "NotFoundError",
    }


def test_before_any_worker_announced_itself_a_model_is_unavailable_not_unknown(gateway):
    client, service = gateway
    for answer in (
        client.get("/v2/models/tiny/ready"),
        client.post("/v2/models/tiny/generate", json={"text_input": "x"}),
    ):
        assert answer.status_code == 503 and answer.json()["error_type"] == "Service Unavailable"
        assert re.fullmatch(
            r"no worker has announced model tiny yet \(\d+ s since this gateway started\)", answer.json()["error"]
        ), answer.text
    service.directory.observe(_heartbeat("w1", ["other"]))
    assert client.get("/v2/models/tiny/ready").status_code == 404
    assert client.get("/v2/models/other/ready").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (
            "/generate",
            {"inputs": "x", "max_new_tokens": 5},
            "max_new_tokens is not a known field here; it belongs in parameters",
        ),
        (
            "/infer_token",
            {"input_id": [1], "temperature": 0.5},
            "temperature is not a known field here; it belongs in parameters",
        ),
        (
            "/v2/models/tiny/generate",
            {"text_input": "x", "parameters": {"text_input": "y"}},
            "parameters.text_input is not a known field here; it belongs at the top level",
        ),
        (
            "/v2/models/tiny/infer",
            {
                "inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1], "seed": 3}],
                "outputs": [{"name": "output0"}],
            },
            "inputs.0.seed is not a known field here; it belongs in inputs.0.parameters",
        ),
        (
            "/v2/models/tiny/infer",
            {
                "inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1]}],
                "outputs": [{"name": "output0", "binary_data": False}],
            },
            "outputs.0.binary_data is not a known field here; it belongs in outputs.0.parameters",
        ),
        ("/generate", {"inputs": "x", "nonsense": 1}, "nonsense is not a known field"),
        # Said only where what the field holds fits: the top level's parameters take no binary_data.
        (
            "/infer_token",
            {"input_id": [1], "parameters": {"parameters": {"seed": 1}}},
            "parameters.parameters is not a known field here; it belongs at the top level",
        ),
        (
            "/infer_token",
            {"input_id": [1], "parameters": {"parameters": {"binary_data": False}}},
            "parameters.parameters is not a known field",
        ),
    ],
)
def test_with_the_strict_setting_a_field_at_the_wrong_level_says_where_it_belongs(strict_client, path, body, error):
    answer = strict_client.post(path, json=body)
    assert answer.status_code == 422 and answer.json() == {"error": error, "error_type": "Input Validation Error"}
    assert "x-ignored-fields" not in answer.headers


def test_with_the_strict_setting_every_unknown_field_is_named_and_known_ones_still_checked(strict_client):
    body = {"text_input": "x", "foo": 1, "parameters": {"bar": 2, "seed": 0}}
    answer = strict_client.post("/v2/models/tiny/generate", json=body)
    assert answer.status_code == 422 and answer.json()["error"] == (
        "parameters.seed: Input should be greater than 0; received 0"
    )
    answer = strict_client.post("/v2/models/tiny/generate", json={**body, "parameters": {"bar": 2}})
    assert answer.status_code == 422 and answer.json()["error"] == (
        "foo is not a known field; parameters.bar is not a known field"
    )


def test_openai_errors_name_the_offending_field_in_param(client, strict_client):
    role = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]})
    assert role.status_code == 400 and role.json()["error"]["param"] == "messages.0.role"
    tokens = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "max_tokens"
    usage = strict_client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "include_usage": True})
    assert usage.status_code == 400 and usage.json()["error"]["param"] == "include_usage"
    assert usage.json()["error"]["message"] == "include_usage is not a known field here; it belongs in stream_options"
    malformed = client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] is None


def test_websocket_errors_echo_the_message_id_and_name_the_ops(client):
    with client.websocket_connect("/ws") as socket:
        socket.send_json({"op": "nope", "id": "s1"})
        assert socket.receive_json() == {
            "id": "s1",
            "data": {"error": f"op 'nope' is not one of {WS_OPS}", "error_type": "Input Validation Error"},
        }
        assert socket.receive_json() == {"id": "s1", "done": True}
        socket.send_json({"id": "s2"})
        assert socket.receive_json()["data"]["error"] == f"op is required: one of {WS_OPS}"
        assert socket.receive_json() == {"id": "s2", "done": True}
        socket.send_text("[1]")  # no id to echo
        assert socket.receive_json() == {
            "id": None,
            "data": {"error": "body: Input should be an object; received list", "error_type": "Input Validation Error"},
        }


def test_with_the_strict_setting_a_websocket_message_with_an_unknown_field_is_refused_naming_it(strict_client):
    with strict_client.websocket_connect("/ws") as socket:
        socket.send_json({"op": "generate_stream", "id": "s3", "model": "tiny", "text_input": "x", "seed": 1})
        assert socket.receive_json() == {
            "id": "s3",
            "data": {
                "error": "seed is not a known field here; it belongs in parameters",
                "error_type": "Input Validation Error",
            },
        }
        assert socket.receive_json() == {"id": "s3", "done": True}
        socket.send_json({"op": "tgi", "id": "s4", "body": {"inputs": "x", "parameters": {"best": 2}}})
        assert socket.receive_json()["data"]["error"] == "body.parameters.best is not a known field"
        assert socket.receive_json() == {"id": "s4", "done": True}


# What makes a browser fetch an address as a page runs, in the pages' scripts and styles: an element's src (in
# HTML, or a React prop: `src:"https://..."`), a stylesheet's url() or @import, a script's fetch() or importScripts().
_FETCHED = re.compile(
    r"(?:\bsrc\s*[=:]\s*|\burl\(\s*|@import\s+|\bfetch\(\s*|\bimportScripts\(\s*)"  # what loads...
    r"""["'`]?((?:https?:)?//[^"'`)\s]+)"""  # ...an absolute address, with its scheme or without
)


def test_docs_pages_load_everything_from_this_server_and_fetch_nothing_elsewhere(client):
    for page in ("/docs", "/redoc"):
        html = client.get(page)
        assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
        assert not re.search(r"https?://", html.text), html.text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert len(assets) >= 2, html.text
        for asset in assets:
            served = client.get(asset)
            assert served.status_code == 200 and len(served.content) > 1000, asset
            assert _FETCHED.findall(served.text) == [], asset  # ReDoc's bundle fetched Redocly's logo from its CDN
    # Swagger UI's default: a badge image from validator.swagger.io, asked about this server's own address.
    assert '"validatorUrl": null' in client.get("/docs").text
    assert client.get("/openapi.json").status_code == 200


def test_the_fetch_pattern_finds_what_the_bundles_fetched_elsewhere():
    found = [
        'r.createElement("img",{alt:"redocly logo",src:"https://cdn.redoc.ly/redoc/logo-mini.svg"})',
        '<img src="//cdn.example/a.png">',
        "background: url('https://fonts.example/x.woff2')",
        "@import 'https://fonts.example/css';",
        "fetch(`https://api.example/v1`)",
    ]
    left = ['<a href="https://redocly.com/redoc/">', 'new URL("https://base")', "s.url()", 'src:"/docs-assets/x.png"']
    assert [_FETCHED.findall(text) for text in found] == [
        ["https://cdn.redoc.ly/redoc/logo-mini.svg"],
        ["//cdn.example/a.png"],
        ["https://fonts.example/x.woff2"],
        ["https://fonts.example/css"],
        ["https://api.example/v1"],
    ]
    assert [_FETCHED.findall(text) for text in left] == [[], [], [], []]
