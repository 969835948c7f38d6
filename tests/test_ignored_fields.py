"""Fields no document lists: accepted, ignored and named on every route, at any depth (API.md, revised
2026-12-05); and `ignore_eos`, read on every generation route.

Against a real `tokenrelay serve` (the bundled model), over HTTP and the WebSocket. The strict setting's
refusals are in test_api_errors.py, the bounds of the fields that are read in test_api_bounds.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import websockets

from schemas.body import Body
from schemas.placement import models_of
from schemas.websocket import WsMessage
from tests.test_api_errors import in_process_gateway

MODEL = "tokenrelay-tiny"
TENSOR = {"name": "input0", "shape": [1], "datatype": "UINT32", "data": [5]}
SHORT = "Hello"  # greedy, the bundled model ends it after 2 tokens (an EOS)


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


def _post(server, path: str, body: dict) -> tuple[httpx.Response, list[str] | None]:
    """The answer, read to its end, and the fields its log line names as ignored (None: the line has none)."""
    request_id = uuid.uuid4().hex
    with httpx.stream("POST", server.url(path), json=body, headers={"X-Request-Id": request_id}, timeout=60) as answer:
        answer.read()
    return answer, _line(server, "http_request", request_id=request_id).get("ignored_fields")


def _line(server, event: str, **fields) -> dict:
    """The one log line of `event` with these fields, once written (a request's, after its answer is sent)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [e for e in server.process.events_named(event) if fields.items() <= e.items()]
        if lines or time.monotonic() > deadline:
            [line] = lines
            return line
        time.sleep(0.02)


def _bodies(annotation) -> set[type]:
    """Every model a value of `annotation` can hold, at any depth."""
    found: set[type] = set()
    pending = models_of(annotation)
    while pending:
        model = pending.pop()
        if model not in found:
            found.add(model)
            pending += [m for info in model.model_fields.values() for m in models_of(info.annotation)]
    return found


def test_every_route_body_and_websocket_message_is_made_of_bodies(tmp_path):
    client, _ = in_process_gateway(tmp_path)

    def walk(routes):
        for route in routes:
            if hasattr(route, "original_router"):  # an included router
                yield from walk(route.original_router.routes)
            elif getattr(route, "body_field", None) is not None:
                yield route.path, route.body_field.field_info.annotation

    bodies = dict(walk(client.app.routes))
    assert {"/infer_token", "/v2/models/{model}/infer", "/v1/responses", "/tokenize", "/v1/load_lora_adapter"} <= set(
        bodies
    )
    parts = {model for annotation in [*bodies.values(), WsMessage] for model in _bodies(annotation)}
    assert len(parts) > 40 and [m.__name__ for m in parts if not issubclass(m, Body)] == []


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        (
            "/infer_token",
            {"input_id": [5], "stream": True, "parameters": {"max_new_tokens": 2, "foo": {"bar": 1}}},
            200,
            "parameters.foo",
        ),
        (
            f"/v2/models/{MODEL}/generate_stream",
            {"text_input": [{"type": "text", "text": "x", "lang": "en"}], "parameters": {"max_new_tokens": 2}},
            200,
            "text_input.0.lang",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {
                "sequence_id": 1,
                "inputs": [{**TENSOR, "parameters": {"max_new_tokens": 2, "shared_memory_region": "r"}}],
                "outputs": [{"name": "output0", "parameters": {"classification": 3}}],
            },
            200,
            "sequence_id, inputs.0.parameters.shared_memory_region, outputs.0.parameters.classification",
        ),
        ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 2, "foo": 1}}, 200, "parameters.foo"),
        (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 2,
                "suffix": "!",
                "stream": True,
                "stream_options": {"include_usage": True, "foo": 1},
            },
            200,
            "suffix, stream_options.foo",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}], "w": 1}],
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": "f", "x": 1}}],
                "tool_choice": "none",
            },
            200,
            "messages.0.w, messages.0.content.0.cache_control, tools.0.function.x",
        ),
        (
            "/v1/responses",
            {
                "model": MODEL,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "zz": 1}]}],
                "max_output_tokens": 2,
                "seed": 1,
            },
            200,
            "seed, input.0.content.0.zz",
        ),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "truncate": 4}, 200, "truncate"),
        ("/tokenize", {"inputs": "x", "truncate": 2}, 200, "truncate"),
        ("/detokenize", {"tokens": [5], "prompt": "x"}, 200, "prompt"),
        (f"/v2/models/{MODEL}/stopInfer", {"id": "nope", "x": 1}, 404, "x"),
    ],
)
def test_each_api_ignores_and_names_unknown_fields_at_any_depth(server, path, body, status, named):
    answer, logged = _post(server, path, body)
    assert answer.status_code == status, answer.text
    assert answer.headers["x-ignored-fields"] == named and logged == named.split(", ")


def test_the_header_lists_at_most_32_fields_each_name_encoded(server):
    odd = {"a.b": 1, "ü\n": 2, "x" * 100: 3}
    many = {f"k{i}": i for i in range(40)}
    answer, logged = _post(server, "/infer", {"inputs": "x", "parameters": {"max_new_tokens": 1, **odd, **many}})
    listed = [
        "parameters.a%2Eb",
        "parameters.%C3%BC%0A",
        "parameters." + "x" * 64 + "%E2%80%A6",
        *(f"parameters.k{i}" for i in range(29)),
        "+11",
    ]
    assert answer.status_code == 200 and answer.headers["x-ignored-fields"] == ", ".join(listed)
    assert logged == listed


def test_a_body_without_unknown_fields_gets_no_header_and_its_line_names_none(server):
    answer, logged = _post(server, "/infer", {"inputs": "x", "parameters": {"max_new_tokens": 1, "ignore_eos": True}})
    assert answer.status_code == 200 and "x-ignored-fields" not in answer.headers and logged is None


def _tokens(path: str, answer: httpx.Response) -> tuple[int, str | None]:
    """Generated tokens and finish reason, as each route's answer says them (details asked for)."""
    if path.startswith("/v2/") and path.endswith("/infer"):  # Triton's token API: the ids
        return answer.json()["outputs"][0]["shape"][1], None
    events = [json.loads(line.split(":", 1)[1]) for line in answer.text.splitlines() if line.startswith("data:")]
    if not events:
        details = answer.json()["details"]
        return details["generated_tokens"], details["finish_reason"]
    return len(events), events[-1]["details"]["finish_reason"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/infer", {"inputs": SHORT}),
        ("/infer", {"inputs": SHORT, "stream": True}),
        ("/infer_token", {"input_id": [1, 6179]}),  # <s> Hello
        (f"/v2/models/{MODEL}/generate", {"text_input": SHORT}),
        (f"/v2/models/{MODEL}/generate_stream", {"text_input": SHORT}),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{**TENSOR, "shape": [2], "data": [1, 6179]}]}),
        ("/generate", {"inputs": SHORT}),
        ("/generate_stream", {"inputs": SHORT}),
    ],
)
def test_ignore_eos_gives_a_fixed_length_answer_on_every_generation_route(server, path, body):
    def ask(ignore_eos: bool) -> tuple[int, str | None]:
        parameters = {"max_new_tokens": 12, "details": True, "ignore_eos": ignore_eos}
        answer, logged = _post(server, path, {**body, "parameters": parameters})
        assert answer.status_code == 200 and logged is None, answer.text
        return _tokens(path, answer)

    ended, fixed = ask(False), ask(True)
    assert ended[0] == 2 and ended[1] in (None, "eos_token")
    assert fixed[0] == 12 and fixed[1] in (None, "length")


def test_a_websocket_message_names_the_fields_it_ignored_before_its_stream(server):
    url = server.url("/ws").replace("http", "ws", 1)
    message = {
        "op": "infer",
        "id": "w1",
        "body": {"inputs": SHORT, "parameters": {"max_new_tokens": 6, "ignore_eos": True}},
    }

    async def stream(extra: dict) -> list[dict]:
        async with websockets.connect(url) as socket:
            await socket.send(json.dumps({**message, **extra}))
            received = []
            while not received or not received[-1].get("done"):
                received.append(json.loads(await asyncio.wait_for(socket.recv(), 60)))
            return received

    received = asyncio.run(stream({"seed": 1, "body": {**message["body"], "n": 2}}))
    assert received[0] == {"id": "w1", "ignored_fields": ["seed", "body.n"]}
    assert [m.get("data", {}).get("token", {}).get("id") is not None for m in received[1:-1]] == [True] * 6
    assert received[-1] == {"id": "w1", "done": True}
    line = _line(server, "websocket_stream", ignored_fields=["seed", "body.n"])
    assert line["outcome"] == "done" and line["events"] == 6
    plain = asyncio.run(stream({}))
    assert "ignored_fields" not in plain[0] and len(plain) == 7
