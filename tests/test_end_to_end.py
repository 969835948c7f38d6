"""A request's whole path, over real HTTP and WebSocket on loopback, through both topologies:

- `tokenrelay serve`: gateway, worker and in-process bus in one process;
- `tokenrelay gateway` + `tokenrelay worker`: two processes on a real Kafka broker.

The same tests run against both. The expected text is what transformers'
own greedy `generate` produces with the bundled model.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
import websockets

from tests.processes import Process, free_port, spawn_tokenrelay, wait_ready
from tests.reference import bundled, greedy_text
from tests.spec_examples import GENERATE

MODEL = "tokenrelay-tiny"
ALIAS = "llama_65b"  # the model name of the spec's generate example
# Greedy decoding with the bundled model ends PROMPT with EOS after a few
# tokens and runs LONG_PROMPT on past 400 tokens.
PROMPT = "The os module provides"
LONG_PROMPT = "The following example"
WORKER_ID = "e2e-worker"


@dataclass
class Deployment:
    base_url: str
    worker: Process  # the process whose log holds the worker's events
    processes: list[Process]
    first_answer_s: float  # from the processes' start to their first answer

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/ws"


@pytest.fixture(scope="module", params=["serve", pytest.param("kafka", marks=pytest.mark.kafka)])
def deployment(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp(request.param)
    port = free_port()
    spawned_at = time.monotonic()
    names = ["--served-model-name", MODEL, ALIAS]
    if request.param == "serve":
        serve = spawn_tokenrelay(["serve", "--port", str(port), "--worker-id", WORKER_ID, *names], logs / "serve.log")
        processes, worker = [serve], serve
    else:
        kafka = [
            "--kafka-bootstrap",
            request.getfixturevalue("kafka_bootstrap"),
            "--topic-prefix",
            f"e2e{uuid.uuid4().hex[:8]}",
        ]
        worker = spawn_tokenrelay(["worker", *kafka, "--worker-id", WORKER_ID, *names], logs / "worker.log")
        gateway = spawn_tokenrelay(["gateway", "--port", str(port), *kafka], logs / "gateway.log")
        processes = [worker, gateway]
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, MODEL, processes)
        first = httpx.post(f"{base_url}/v2/models/{MODEL}/generate", json={"text_input": PROMPT}, timeout=60)
        assert first.status_code == 200, first.text
        yield Deployment(base_url, worker, processes, first_answer_s=time.monotonic() - spawned_at)
    finally:
        for process in processes:
            assert process.stop() == 0, process.log_tail()
            # Every line is a JSON event: no traceback, no "Unclosed" warning, from start to SIGTERM.
            assert process.raw_lines() == [], process.log_tail()


def _stream_events(base_url: str, model: str, body: dict) -> list[dict]:
    """The `data:` objects of a generate_stream answer, checking MindIE's framing on the way."""
    events = []
    with httpx.stream("POST", f"{base_url}/v2/models/{model}/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data:{"), line  # no space after the colon on the Triton routes
                events.append(json.loads(line[len("data:") :]))
    return events


def _finished(worker: Process, reason: str) -> list[dict]:
    return [e for e in worker.events_named("request_finished") if e["finish_reason"] == reason]


def test_the_first_answer_comes_seconds_after_the_start(deployment, request, capsys):
    topology = request.node.callspec.params["deployment"]
    with capsys.disabled():  # the figure, for the record; the clock of a shared machine is no assertion
        sys.stderr.write(f"\n{topology}: first answer {deployment.first_answer_s:.1f} s after the start\n")
    assert deployment.first_answer_s < 180  # wait_ready's own bound: it answered at all


def test_generate_answers_what_transformers_generates_up_to_eos(deployment):
    response = httpx.post(
        f"{deployment.base_url}/v2/models/{MODEL}/generate",
        json={"text_input": PROMPT, "parameters": {"max_new_tokens": 16}},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "model_name", "model_version", "text_output"}
    assert body["model_name"] == MODEL and body["model_version"] is None
    assert body["text_output"] == greedy_text(PROMPT, 16)
    assert (
        httpx.post(  # and again with details, which say why it ended
            f"{deployment.base_url}/v2/models/{MODEL}/generate",
            json={"text_input": PROMPT, "parameters": {"max_new_tokens": 16, "details": True}},
            timeout=60,
        ).json()["details"]["finish_reason"]
        == "eos_token"
    )


def test_generate_stream_pieces_concatenate_to_the_generated_text(deployment):
    events = _stream_events(
        deployment.base_url,
        MODEL,
        {"id": "s1", "text_input": LONG_PROMPT, "parameters": {"max_new_tokens": 12, "details": True}},
    )
    assert len(events) == 12
    assert "".join(e["text_output"] for e in events) == greedy_text(LONG_PROMPT, 12)
    assert [e["details"]["generated_tokens"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["id"] == "s1" and e["model_name"] == MODEL and e["model_version"] is None for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"
    assert all("finish_reason" not in e["details"] for e in events[:-1])
    assert events[0]["prefill_time"] > 0 and events[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] > 0 for e in events[1:])
    assert all(e["details"]["batch_size"] >= 1 and e["details"]["queue_wait_time"] >= 0 for e in events)


def test_the_spec_generate_example_is_answered_under_its_model_name(deployment):
    first = httpx.post(f"{deployment.base_url}/v2/models/{ALIAS}/generate", json=GENERATE, timeout=120)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["id"] == "a123" and body["model_name"] == ALIAS and body["model_version"] is None
    assert isinstance(body["text_output"], str) and body["text_output"]
    details = body["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "first_token_cost", "decode_cost"}
    assert details["finish_reason"] in ("length", "eos_token")
    assert 1 <= details["generated_tokens"] <= 250
    assert details["first_token_cost"] is None and details["decode_cost"] is None
    # Seeded: the same request draws the same tokens.
    again = httpx.post(f"{deployment.base_url}/v2/models/{ALIAS}/generate", json=GENERATE, timeout=120)
    assert again.json() == body


def test_priority_reaches_the_worker(deployment):
    events = _stream_events(
        deployment.base_url, MODEL, {"text_input": "urgent", "parameters": {"max_new_tokens": 2, "priority": 1}}
    )
    assert len(events) == 2
    assert any(e["priority"] == 1 for e in deployment.worker.events_named("request_admitted"))


def _ws_streams() -> dict[str, dict]:
    """Eleven streams for one socket: every streaming API twice (greedy, 12 tokens), one to cancel once it has
    streamed, and one cancelled as soon as it is sent (before its request is in flight, as a rule)."""
    greedy = {"max_new_tokens": 12}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 12, "temperature": 0}
    triton = {"op": "generate_stream", "model": MODEL, "text_input": LONG_PROMPT}
    streams = {}
    for i in range(2):
        streams[f"triton{i}"] = {**triton, "parameters": greedy}
        streams[f"infer{i}"] = {"op": "infer", "body": {"inputs": LONG_PROMPT, "stream": True, "parameters": greedy}}
        streams[f"tgi{i}"] = {"op": "tgi", "body": {"inputs": LONG_PROMPT, "parameters": greedy}}
        streams[f"completions{i}"] = {
            "op": "completions",
            "body": {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0},
        }
    streams["chat"] = {"op": "chat.completions", "body": chat}
    streams["stop"] = {**triton, "parameters": {"max_new_tokens": 400, "details": True}}
    streams["early"] = {**triton, "parameters": {"max_new_tokens": 400, "details": True}}
    return streams


def _ws_text(stream_id: str, events: list[dict]) -> str:
    """The text a stream of that API carried."""
    api = stream_id.rstrip("0123456789")
    if api == "triton":
        return "".join(e["text_output"] for e in events)
    if api == "infer":
        return events[-1]["generated_text"]
    if api == "tgi":
        return "".join(e["token"]["text"] for e in events)
    if api == "completions":
        return "".join(e["choices"][0]["text"] for e in events)
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events)


def test_websocket_runs_every_streaming_api_side_by_side_and_cancels_one(deployment):
    streams = _ws_streams()

    async def scenario() -> dict[str, list[dict]]:
        received: dict[str, list[dict]] = {stream_id: [] for stream_id in streams}
        done: set[str] = set()
        async with websockets.connect(deployment.ws_url) as socket:
            for stream_id, message in streams.items():
                await socket.send(json.dumps({**message, "id": stream_id}))
            await socket.send(json.dumps({"op": "cancel", "id": "early"}))
            while done != set(streams):
                message = json.loads(await asyncio.wait_for(socket.recv(), 60))
                if message.get("done"):
                    done.add(message["id"])
                    continue
                received[message["id"]].append(message["data"])
                if message["id"] == "stop" and len(received["stop"]) == 3:
                    await socket.send(json.dumps({"op": "cancel", "id": "stop"}))
        return received

    cancelled_before = len(_finished(deployment.worker, "stop_sequence"))
    received = asyncio.run(scenario())
    expected = greedy_text(LONG_PROMPT, 12)
    for stream_id in streams.keys() - {"chat", "stop", "early"}:
        assert _ws_text(stream_id, received[stream_id]) == expected, stream_id
    assert received["chat"][0]["choices"][0]["delta"]["role"] == "assistant"
    assert received["chat"][-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert _ws_text("chat", received["chat"])
    assert 3 <= len(received["stop"]) < 400
    # Ended as stopInfer ends a stream: its last event carries the finish reason, whenever the cancel came.
    for cancelled in ("stop", "early"):
        assert received[cancelled][-1]["details"]["finish_reason"] == "stop_sequence", received[cancelled][-1]
        assert received[cancelled][-1]["details"]["generated_tokens"] < 400
    _wait_for(lambda: len(_finished(deployment.worker, "stop_sequence")) > cancelled_before)


def test_a_client_that_disconnects_stops_its_generation(deployment):
    cancelled_before = len(_finished(deployment.worker, "stop_sequence"))
    body = {"text_input": LONG_PROMPT, "parameters": {"max_new_tokens": 400}}
    with httpx.stream("POST", f"{deployment.base_url}/v2/models/{MODEL}/generate_stream", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:{")
    _wait_for(lambda: len(_finished(deployment.worker, "stop_sequence")) > cancelled_before)
    assert _finished(deployment.worker, "stop_sequence")[-1]["generated_tokens"] < 400


def test_stop_infer_ends_a_running_stream_and_frees_its_slot(deployment):
    stop_url = f"{deployment.base_url}/v2/models/{MODEL}/stopInfer"
    missing = httpx.post(stop_url, json={"id": "nobody"})
    assert missing.status_code == 404 and missing.json()["error_type"] == "NotFoundError"
    body = {"id": "stopme", "text_input": LONG_PROMPT, "parameters": {"max_new_tokens": 400, "details": True}}
    events = []
    with httpx.stream("POST", f"{deployment.base_url}/v2/models/{MODEL}/generate_stream", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(json.loads(line[len("data:") :]))
                if len(events) == 2:
                    stopped = httpx.post(stop_url, json={"id": "stopme"})
                    assert stopped.status_code == 200 and stopped.json() == {"id": "stopme"}
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert 2 <= len(events) < 400
    # The slot is free: the next request runs alone.
    admitted_before = len(deployment.worker.events_named("request_admitted"))
    httpx.post(f"{deployment.base_url}/v2/models/{MODEL}/generate", json={"text_input": "x"}, timeout=60)
    assert deployment.worker.events_named("request_admitted")[admitted_before]["running"] == 1


def test_errors_name_what_is_wrong(deployment):
    url = f"{deployment.base_url}/v2/models/{MODEL}/generate"
    unknown = httpx.post(f"{deployment.base_url}/v2/models/nope/generate", json={"text_input": "x"})
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "NotFoundError"
    cold = httpx.post(url, json={"text_input": "x", "parameters": {"temperature": 0}})
    assert cold.status_code == 422 and cold.json()["error_type"] == "Input Validation Error"
    assert (
        "parameters.temperature" in cold.json()["error"] and "greater than 0.000001; received 0" in cold.json()["error"]
    )
    # A misspelt field is a field no document lists: answered, and named as ignored (API.md, 2026-12-05).
    extra = httpx.post(url, json={"text_input": "x", "parameters": {"temprature": 0.5, "max_new_tokens": 2}})
    assert extra.status_code == 200 and extra.headers["x-ignored-fields"] == "parameters.temprature", extra.text
    for malformed in (b'{"text_input": ', b'{"text_input": "\xff\xfe"}'):  # cut short; not UTF-8
        broken = httpx.post(url, content=malformed, headers={"content-type": "application/json"})
        assert broken.status_code == 422 and broken.json()["error_type"] == "Input Validation Error", broken.text


def test_one_request_id_finds_a_request_in_the_gateways_and_the_workers_lines(deployment):
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    answer = httpx.post(
        f"{deployment.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
        headers={"X-Request-Id": request_id},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.headers["x-request-id"] == request_id
    assert answer.json()["id"] == f"chatcmpl-{request_id}"
    gateway = deployment.processes[-1]  # serve: the one process; on Kafka: the gateway, started last

    def lines(process: Process, *names: str) -> list[dict]:
        return [e for e in process.events() if e.get("request_id") == request_id and e["event"] in names]

    # Each process logs once it is done with the request: the gateway its access line once the answer is sent,
    # the worker the request's end once its last event is: maybe a moment after the client has the answer.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        access = lines(gateway, "http_request")
        worker_lines = lines(deployment.worker, "request_admitted", "request_finished")
        if access and len(worker_lines) >= 2:
            break
        time.sleep(0.05)
    assert [(e["method"], e["route"], e["status"]) for e in access] == [("POST", "/v1/chat/completions", 200)]
    assert [e["event"] for e in worker_lines] == ["request_admitted", "request_finished"]
    assert {e["worker_id"] for e in worker_lines} == {WORKER_ID}
    generation = worker_lines[0]["generation_id"]
    assert generation != request_id and all(e["generation_id"] == generation for e in worker_lines)


def test_tokenize_and_detokenize_are_answered_by_a_worker_as_its_tokenizer_does(deployment):
    tokenizer = bundled().tokenizer
    ids = tokenizer(PROMPT)["input_ids"]
    vllm = httpx.post(f"{deployment.base_url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=60)
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["tokens"] == ids and vllm.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    tgi = httpx.post(f"{deployment.base_url}/tokenize", json={"inputs": PROMPT}, timeout=60).json()
    assert [t["id"] for t in tgi] == ids and all(t["text"] == PROMPT[t["start"] : t["stop"]] for t in tgi)
    chat = [{"role": "user", "content": PROMPT}]
    tokenized = httpx.post(f"{deployment.base_url}/tokenize", json={"messages": chat}, timeout=60).json()
    assert tokenized["tokens"] == tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    bare = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    decoded = httpx.post(f"{deployment.base_url}/detokenize", json={"tokens": bare}, timeout=60)
    assert decoded.status_code == 200 and decoded.json() == {"prompt": PROMPT}, decoded.text


def test_health_and_readiness(deployment):
    for path in (
        "/health",
        "/v2/health/live",
        "/v2/health/ready",
        f"/v2/models/{MODEL}/ready",
        f"/v2/models/{ALIAS}/ready",
    ):
        assert httpx.get(deployment.base_url + path).status_code == 200, path
    for name in (MODEL, ALIAS):  # an alias's readiness names the model it is an alias of
        ready = httpx.get(f"{deployment.base_url}/v2/models/{name}/ready").json()
        assert ready == {"model": MODEL, "ready": True, "workers": 1}
    assert httpx.get(f"{deployment.base_url}/v2/health/ready").json() == {
        "ready": True,
        "models": sorted([MODEL, ALIAS]),
    }
    unknown = httpx.get(f"{deployment.base_url}/v2/models/nope/ready")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == f"model nope is not served here; served: {', '.join(sorted([ALIAS, MODEL]))}"


@pytest.mark.kafka
def test_the_gateway_answers_503_when_no_worker_serves_a_known_model(kafka_bootstrap, spawn, topic_prefix):
    port = free_port()
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    worker = spawn("worker", *kafka, "--heartbeat-interval", "0.5")
    gateway = spawn("gateway", "--port", str(port), *kafka)
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, MODEL, [worker, gateway])
    assert worker.stop() == 0  # a clean stop announces that it leaves
    answer = httpx.post(f"{base_url}/v2/models/{MODEL}/generate", json={"text_input": "x"})
    assert answer.status_code == 503 and answer.json()["error_type"] == "Service Unavailable"
    assert httpx.get(f"{base_url}/v2/models/{MODEL}/ready").status_code == 503
    assert httpx.post(f"{base_url}/v2/models/other/generate", json={"text_input": "x"}).status_code == 404


def _wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
