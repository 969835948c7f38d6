"""MindIE's own request examples, replayed verbatim, and the documented shapes of the answers.

The server serves the bundled model under the names the examples use
(llama_65b, llama3-70b). Also here: what the contract adds to the examples
(details on and off, the drawn seed, fullTextEnabled, recomputation,
metadata, 413).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.processes import metric, serving
from tests.spec_examples import (
    GENERATE,
    GENERATE_MODEL,
    GENERATE_STREAM,
    GENERATE_STREAM_MODEL,
    GENERATE_STREAM_MULTIMODAL,
    INFER_TOKEN,
    TRITON_INFER,
    TRITON_INFER_MODEL,
)

NAMES = ["--served-model-name", "tokenrelay-tiny", "llama_65b", "llama3-70b"]
LONG_PROMPT = "The following example"  # greedy: no EOS for hundreds of tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("examples"), *NAMES, "--max-request-length", "1") as served:
        yield served


def _events(response: httpx.Response, prefix: str) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith(prefix + "{"), line
            events.append(json.loads(line[len(prefix) :]))
    return events


def _stream(url: str, body: dict, prefix: str) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return _events(response, prefix)


def _is_details(details: dict) -> bool:
    return (
        set(details) == {"finish_reason", "generated_tokens", "seed"}
        and details["finish_reason"] in ("length", "eos_token")
        and type(details["generated_tokens"]) is int
        and type(details["seed"]) is int
    )


def test_infer_token_example(server):
    response = httpx.post(server.url("/infer_token"), json=INFER_TOKEN, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"generated_text", "details"}
    assert isinstance(body["generated_text"], str) and _is_details(body["details"])
    assert 1 <= body["details"]["generated_tokens"] <= 20


def test_infer_token_example_streamed_and_its_drawn_seed_reproduces_it(server):
    events = _stream(server.url("/infer_token"), {**INFER_TOKEN, "stream": True}, prefix="data: ")
    *pieces, last = events
    for event in pieces:
        assert set(event) == {"prefill_time", "decode_time", "token"}
        assert set(event["token"]) == {"id", "text"} and len(event["token"]["id"]) == 1
        assert isinstance(event["token"]["text"], str)
    assert set(last) == {"prefill_time", "decode_time", "generated_text", "details", "token"}
    assert last["token"]["text"] is None and len(last["token"]["id"]) == 1
    assert _is_details(last["details"]) and last["details"]["generated_tokens"] == len(events)
    assert last["generated_text"].startswith("".join(e["token"]["text"] for e in pieces))
    assert isinstance(events[0]["prefill_time"], float) and events[0]["decode_time"] is None
    # The seed the server drew, sent back, draws the same tokens.
    again = {**INFER_TOKEN, "parameters": {**INFER_TOKEN["parameters"], "seed": last["details"]["seed"]}}
    replay = httpx.post(server.url("/infer_token"), json=again, timeout=60).json()
    assert replay["generated_text"] == last["generated_text"]
    assert replay["details"] == last["details"]


def test_generate_example_and_with_priority_and_timeout_as_its_sibling_routes_take_them(server):
    url = server.url(f"/v2/models/{GENERATE_MODEL}/generate")
    answer = httpx.post(url, json=GENERATE, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"id", "model_name", "model_version", "text_output", "details"} and body["id"] == "a123"
    assert body["model_name"] == GENERATE_MODEL and body["text_output"]
    assert body["details"]["finish_reason"] in ("length", "eos_token")
    queued = {**GENERATE, "parameters": {**GENERATE["parameters"], "priority": 1, "timeout": 30}}
    again = httpx.post(url, json=queued, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["text_output"] == body["text_output"]  # seeded: the same draw, whatever its priority


def test_generate_stream_example(server):
    url = server.url(f"/v2/models/{GENERATE_STREAM_MODEL}/generate_stream")
    events = _stream(url, GENERATE_STREAM, prefix="data:")
    assert 1 <= len(events) <= 5
    for number, event in enumerate(events, start=1):
        assert list(event) == [
            "id",
            "model_name",
            "model_version",
            "text_output",
            "details",
            "prefill_time",
            "decode_time",
        ]
        assert (event["id"], event["model_name"], event["model_version"]) == ("a123", "llama3-70b", None)
        details = event["details"]
        expected = {"generated_tokens", "first_token_cost", "decode_cost", "batch_size", "queue_wait_time"}
        assert set(details) == (expected | {"finish_reason"} if number == len(events) else expected)
        assert details["generated_tokens"] == number
        assert details["first_token_cost"] is None and details["decode_cost"] is None
        assert type(details["batch_size"]) is int and type(details["queue_wait_time"]) is int
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert isinstance(events[0]["prefill_time"], float) and events[0]["decode_time"] is None


def test_generate_stream_multimodal_example_is_refused_by_a_text_model(server):
    url = server.url(f"/v2/models/{GENERATE_STREAM_MODEL}/generate_stream")
    response = httpx.post(url, json=GENERATE_STREAM_MULTIMODAL, timeout=60)
    assert response.status_code == 422
    assert response.json()["error_type"] == "Input Validation Error"
    # The example's placeholder path lies outside the media directory.
    assert "/xxxx/test.png is not under the media directory" in response.json()["error"]


def test_triton_infer_example(server):
    response = httpx.post(server.url(f"/v2/models/{TRITON_INFER_MODEL}/infer"), json=TRITON_INFER, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "42" and len(body["outputs"]) == 1
    output = body["outputs"][0]
    assert output["name"] == "output0" and output["datatype"] == "UINT32"
    assert output["shape"] == [1, len(output["data"])] and 1 <= len(output["data"]) <= 20
    assert all(type(t) is int and 0 <= t < 32000 for t in output["data"])


def test_details_off_leaves_them_out(server):
    body = {"input_id": [5618, 19678], "parameters": {"max_new_tokens": 3}}
    assert set(httpx.post(server.url("/infer_token"), json=body, timeout=60).json()) == {"generated_text"}
    *_, last = _stream(server.url("/infer_token"), {**body, "stream": True}, prefix="data: ")
    assert last["details"] is None
    events = _stream(
        server.url("/v2/models/tokenrelay-tiny/generate_stream"), {"text_input": LONG_PROMPT}, prefix="data:"
    )
    assert all("details" not in e for e in events)


def test_infer_takes_text_and_text_only_lists(server):
    text = httpx.post(server.url("/infer"), json={"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 4}})
    items = [{"type": "text", "text": LONG_PROMPT}]
    listed = httpx.post(server.url("/infer"), json={"inputs": items, "parameters": {"max_new_tokens": 4}})
    assert text.status_code == listed.status_code == 200
    assert text.json()["generated_text"] == listed.json()["generated_text"]  # greedy, same prompt


def test_recomputation_continues_the_count_and_the_timings(server):
    body = {
        "text_input": LONG_PROMPT,
        "parameters": {"details": True, "max_new_tokens": 6, "firstTokenCost": 40, "decodeTime": [12, 11]},
    }
    events = _stream(server.url("/v2/models/tokenrelay-tiny/generate_stream"), body, prefix="data:")
    assert [e["details"]["generated_tokens"] for e in events] == [4, 5, 6]
    assert all(e["prefill_time"] is None and e["decode_time"] > 0 for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"


def test_metadata(server):
    assert httpx.get(server.url("/v2")).json() == {
        "name": "tokenrelay",
        "version": "0.1.0",
        "extensions": ["binary_tensor_data", "model_configuration"],
    }
    model = httpx.get(server.url("/v2/models/llama3-70b")).json()
    assert model["name"] == "llama3-70b"
    assert model["inputs"] == [{"name": "input0", "datatype": "UINT32", "shape": [-1]}]
    assert model["outputs"] == [{"name": "output0", "datatype": "UINT32", "shape": [-1]}]
    unknown = httpx.get(server.url("/v2/models/nope"))
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "NotFoundError"
    versioned = httpx.post(server.url("/v2/models/llama3-70b/versions/1/generate"), json={"text_input": "x"})
    assert versioned.status_code == 404 and set(versioned.json()) == {"error", "error_type"}


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(server):
    oversized = b"{" + b" " * (1024 * 1024) + b"}"  # 1 MB + 2 bytes, and not even valid JSON
    answer = httpx.post(server.url("/v2/models/tokenrelay-tiny/generate"), content=oversized)
    assert answer.status_code == 413 and answer.json()["error_type"] == "Payload Too Large"

    def chunks():  # no Content-Length: the limit must bite while reading
        for _ in range(3):
            yield b" " * (512 * 1024)

    chunked = httpx.post(server.url("/infer_token"), content=chunks())
    assert chunked.status_code == 413 and "at most 1048576" in chunked.json()["error"]
    assert httpx.post(
        server.url("/infer_token"), json={"input_id": [5], "parameters": {"max_new_tokens": 1}}
    ).is_success


def test_full_text_enabled_streams_the_text_so_far(tmp_path):
    with serving(tmp_path, "--full-text-enabled") as served:
        body = {"text_input": LONG_PROMPT, "parameters": {"max_new_tokens": 6}}
        events = _stream(served.url("/v2/models/tokenrelay-tiny/generate_stream"), body, prefix="data:")
        texts = [e["text_output"] for e in events]
        assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
        full = httpx.post(served.url("/v2/models/tokenrelay-tiny/generate"), json=body, timeout=60).json()
        assert texts[-1] == full["text_output"]
        native = {"inputs": LONG_PROMPT, "stream": True, "parameters": {"max_new_tokens": 6}}
        tokens = _stream(served.url("/infer_token"), native, prefix="data: ")
        pieces = [e["token"]["text"] for e in tokens[:-1]]
        assert all(later.startswith(earlier) for earlier, later in zip(pieces, pieces[1:], strict=False))
        assert tokens[-1]["generated_text"].startswith(pieces[-1])


def test_metrics_count_requests_tokens_and_latencies_on_gateway_and_worker(server):
    before = httpx.get(server.url("/metrics"))
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    body = {"text_input": LONG_PROMPT, "parameters": {"max_new_tokens": 3}}
    assert httpx.post(server.url("/v2/models/llama3-70b/generate"), json=body, timeout=60).status_code == 200
    after = httpx.get(server.url("/metrics")).text

    def added(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before.text, name, **labels)

    model = "tokenrelay-tiny"  # aliases count under the canonical name
    for component in ("gateway", "worker"):  # `serve` is both, in one registry
        family = f"tokenrelay_{component}"
        assert added(f"{family}_requests_total", model=model, priority="5", outcome="length") == 1
        assert added(f"{family}_generated_tokens_total", model=model) == 3
        for histogram, observations in [
            ("time_to_first_token_seconds", 1),
            ("queue_time_seconds", 1),
            ("inter_token_latency_seconds", 2),
            ("e2e_request_latency_seconds", 1),
        ]:
            assert added(f"{family}_{histogram}_count", model=model, priority="5") == observations, histogram
        assert metric(after, f"{family}_requests_running", model=model) == 0
        assert metric(after, f"{family}_requests_waiting", model=model) == 0
