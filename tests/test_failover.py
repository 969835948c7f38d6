"""Failover on a real Kafka broker: a worker SIGKILLed mid-stream is invisible to the clients.

The gateway notices the dead worker (its heartbeats stop while the control
topic works) and re-publishes each of its requests as a recomputation from the
last delivered token; another worker prefills it and continues. Seeded
sampling makes the continuation exact, so every stream must equal its run
without a failure, token for token.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import jsonschema
import pytest

from tests.processes import Process, free_port, metric, usage_of, wait_ready
from tests.vision_models import data_uri
from tokenrelay.bench.chaos import FAILURES, PROMPTS, Kind, Workers, run_chaos
from tokenrelay.topology import tokenrelay_processes
from tokenrelay.topology import wait_ready as wait_gateway_ready
from workers.bundled import BUNDLED_ADAPTERS, BUNDLED_VISION_MODEL_NAME
from workers.bundled.training.vision_model import draw_example

pytestmark = pytest.mark.kafka

MODEL = "tokenrelay-tiny"


def _body(i: int) -> dict:
    """Seeded sampling, 96 tokens, details: the chaos bench's kind of request."""
    return Kind(PROMPTS[i % len(PROMPTS)], seed=1000 + i, max_new_tokens=96).body()


class _Stream:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.counts: list[int] = []  # generated_tokens of each event: 1, 2, 3... unless a token is lost or doubled
        self.done = False

    async def run(self, client: httpx.AsyncClient, url: str, body: dict) -> _Stream:
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[len("data:") :])
                    assert "error" not in event, event
                    self.texts.append(event["text_output"])
                    self.counts.append(event["details"]["generated_tokens"])
        self.done = True
        return self


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "parts": {"type": "array", "items": {"enum": ["head", "body", "tail"]}, "maxItems": 4},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "parts", "size"],
    "additionalProperties": False,
}


TOOL = {
    "type": "function",
    "function": {"name": "describe", "description": "Describe a thing.", "parameters": SCHEMA},
}


class _StructuredStream:
    """An OpenAI chat stream whose answers match SCHEMA, with each token's log-probability: a json_schema
    response format, or (`tool`) a forced call of a function of that schema; `n` choices."""

    def __init__(self, seed: int, tool: bool = False, n: int = 1) -> None:
        self.body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[seed % len(PROMPTS)]}],
            "max_tokens": 120,
            "temperature": 1,
            "seed": seed,
            "n": n,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
        if tool:
            self.body |= {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "describe"}}}
        else:
            self.body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        self.texts = [""] * n  # each choice's content, or its call's arguments
        self.tokens: list[list[tuple[str, float, list[str]]]] = [[] for _ in range(n)]

    async def run(self, client: httpx.AsyncClient, base_url: str) -> None:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=self.body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        delta, i = choice["delta"], choice["index"]
                        self.texts[i] += delta.get("content") or ""
                        for call in delta.get("tool_calls") or ():
                            self.texts[i] += call["function"].get("arguments") or ""
                        for entry in (choice.get("logprobs") or {}).get("content") or ():
                            tops = [t["token"] for t in entry["top_logprobs"]]
                            self.tokens[i].append((entry["token"], entry["logprob"], tops))


async def _streams(url: str, count: int, while_running=None) -> tuple[list[_Stream], list, list[_ImageStream]]:
    """`count` text streams (every other one under the LoRA adapter `shout`), 12 structured ones (6 json_schema,
    4 forced tool calls, 2 json_schema of two choices each) and 4 about pictures (on the vision model's workers),
    at once."""
    streams = [_Stream() for _ in range(count)]
    structured = [
        *(_StructuredStream(seed) for seed in range(6)),
        *(_StructuredStream(seed, tool=True) for seed in range(6, 10)),
        *(_StructuredStream(seed, n=2) for seed in (10, 11)),
    ]
    images = [_ImageStream(seed) for seed in range(4)]
    base_url = url.split("/v2/")[0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        adapted = url.replace(f"/{MODEL}/", "/shout/")
        tasks = [asyncio.create_task(s.run(client, adapted if i % 2 else url, _body(i))) for i, s in enumerate(streams)]
        tasks += [asyncio.create_task(s.run(client, base_url)) for s in [*structured, *images]]
        if while_running is not None:
            await while_running(streams, images)
        await asyncio.wait_for(asyncio.gather(*tasks), 150)  # none hangs
    return streams, structured, images


class _ImageStream:
    """An OpenAI chat stream about a picture, sampled with a seed, on past its answer (ignore_eos)."""

    def __init__(self, seed: int) -> None:
        image, question, _ = draw_example(random.Random(seed))
        content = [{"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": question}]
        self.body = {
            "model": BUNDLED_VISION_MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 48,
            "temperature": 1,
            "seed": seed,
            "ignore_eos": True,
            "stream": True,
        }
        self.pieces: list[str] = []

    async def run(self, client: httpx.AsyncClient, base_url: str) -> None:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=self.body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
                    if delta.get("content"):
                        self.pieces.append(delta["content"])


def _joined(worker: Process) -> bool:
    return any(e.get("partitions", 0) > 0 for e in worker.events_named("partitions_assigned"))


async def test_a_worker_killed_mid_stream_leaves_32_seeded_streams_identical(kafka_bootstrap, topic_prefix, spawn):
    """And so do image requests: a worker of the vision model is killed too; the images travel in the request,
    so the worker that takes over encodes the same bytes; and those of a LoRA adapter, which both workers serve.
    Every worker speculates (prompt lookup): whichever worker computes a token, proposals or none, it is the same."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    lora = ["--lora", f"shout={BUNDLED_ADAPTERS['shout']}"]
    speculative = ["--speculative", "ngram", "--speculative-always"]
    metrics = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    workers = [
        spawn("worker", *kafka, *lora, *speculative, "--worker-id", f"w{i}", "--metrics-address", metrics[i])
        for i in range(2)
    ]
    vision = [spawn("worker", *kafka, "--vision", *speculative, "--worker-id", f"v{i}") for i in range(2)]
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka)
    wait_ready(f"http://127.0.0.1:{port}", MODEL, [*workers, gateway])
    wait_ready(f"http://127.0.0.1:{port}", BUNDLED_VISION_MODEL_NAME, [*vision, gateway])
    deadline = time.monotonic() + 60
    while not all(_joined(w) for w in [*workers, *vision]):  # each pair shares its partitions before the reference
        assert time.monotonic() < deadline, [w.log_tail() for w in workers]
        await asyncio.sleep(0.2)
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/generate_stream"
    reference, reference_structured, reference_images = await _streams(url, 32)

    killed: list[str] = []

    def busier(pair: list[Process], before: list[int]) -> int:
        """The one of the pair that took more of this run's requests (where the router sends them depends on
        its load reports)."""
        taken = [len(w.events_named("request_admitted")) - b for w, b in zip(pair, before, strict=True)]
        assert max(taken) > 0, taken
        return taken.index(max(taken))

    admitted_before = [len(w.events_named("request_admitted")) for w in workers]
    vision_admitted_before = [len(w.events_named("request_admitted")) for w in vision]

    async def kill_mid_stream(streams: list[_Stream], images: list[_ImageStream]) -> None:
        while min(len(s.pieces) for s in images) < 6:
            await asyncio.sleep(0.02)
        victim = busier(vision, vision_admitted_before)
        killed.append(f"v{victim}")
        vision[victim].popen.send_signal(signal.SIGKILL)
        while sum(len(s.counts) >= 8 for s in streams) < 24:
            await asyncio.sleep(0.05)
        victim = busier(workers, admitted_before)
        killed.append(f"w{victim}")
        workers[victim].popen.send_signal(signal.SIGKILL)

    failed, failed_structured, failed_images = await _streams(url, 32, kill_mid_stream)

    for i, (expected, got) in enumerate(zip(reference, failed, strict=True)):
        assert got.counts == list(range(1, len(got.counts) + 1)), i  # no token missing, none twice
        assert "".join(got.texts) == "".join(expected.texts) and got.counts == expected.counts, i
    # Structured streams with log-probabilities: the same tokens and text, log-probabilities equal up to the
    # float32 rounding of a prefill against decode steps, and answers that still match the schema.
    # The same for forced tool calls (their arguments) and for each of n choices.
    for i, (expected_stream, got_stream) in enumerate(zip(reference_structured, failed_structured, strict=True)):
        choices = zip(expected_stream.texts, got_stream.texts, expected_stream.tokens, got_stream.tokens, strict=True)
        for expected_text, got_text, expected, got in choices:
            jsonschema.validate(json.loads(got_text), SCHEMA)
            assert got_text == expected_text and [t[0] for t in got] == [t[0] for t in expected], i
            assert [t[1] for t in got] == pytest.approx([t[1] for t in expected], abs=1e-4), i
            assert [t[2] for t in got] == [t[2] for t in expected], i
    assert [s.pieces for s in failed_images] == [s.pieces for s in reference_images]
    failovers = gateway.events_named("request_failing_over")
    assert failovers and {f["reason"] for f in failovers} == {"worker gone"}, failovers
    assert {f["worker_id"] for f in failovers} == set(killed)
    assert sum(f["structured"] for f in failovers) >= 1, [f["structured"] for f in failovers]
    [survivor] = [i for i in range(2) if f"w{i}" not in killed]
    survived = httpx.get(f"http://{metrics[survivor]}/metrics").text
    assert metric(survived, "tokenrelay_worker_speculative_accepted_tokens_total", model=MODEL) > 0, survived


def test_forty_seconds_of_chaos_lose_nothing(kafka_bootstrap, topic_prefix, tmp_path):
    """2 gateways, 3 workers, steady load; a worker SIGKILLed and restarted every 10 s (longer soaks, and with the
    bundled model: `tokenrelay bench chaos`). The workers are the real workers and engines around simulated
    models (seeded tokens, the bundled model's step times): one restarts in a second or two, not in the ten
    that loading torch takes on two cores, so that a kill never meets a worker still starting."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    simulated = ["--simulate", "bundled-cpu", "--served-model-name", MODEL]
    workers = Workers([*kafka, *simulated], 3, tmp_path)
    ports = [free_port(), free_port()]
    try:
        with tokenrelay_processes([["gateway", *kafka, "--port", str(port)] for port in ports], tmp_path) as gateways:
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            for url in urls:
                wait_gateway_ready(url, MODEL, [*gateways, *workers.processes])
            result = asyncio.run(
                run_chaos(urls, workers, duration_s=40, kill_every_s=10, concurrency=8, hang_after_s=60)
            )
    finally:
        workers.stop()
    print(result)  # the counts, for the CI log
    assert result["workers_killed"] == 3 and result["requests"] > 40, result
    assert {o: result[o] for o in FAILURES} == dict.fromkeys(FAILURES, 0), result
    # Usage, metered once per request whatever the kills: one record for each stream the clients saw end (none
    # twice), and as many output tokens as they received.
    usage = usage_of(kafka_bootstrap, topic_prefix)
    (row,) = usage["rows"]
    assert usage["records"] == usage["requests"] == row["finished"] == result["streams_ended"], (usage, result)
    assert row["output_tokens"] == result["output_tokens"], (usage, result)
