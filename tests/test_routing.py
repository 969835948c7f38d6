"""Routing on a real Kafka broker with real workers (the bundled model): cache, room, and stopInfer anywhere."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.processes import free_port, metric, wait_ready

pytestmark = pytest.mark.kafka

MODEL = "tokenrelay-tiny"
SYSTEM = "You are a helpful assistant who answers questions about the history of the Roman empire. " * 8


async def _generate(client: httpx.AsyncClient, base: str, text: str, tokens: int) -> dict:
    body = {"text_input": text, "parameters": {"max_new_tokens": tokens, "do_sample": False}}
    response = await client.post(f"{base}/v2/models/{MODEL}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _routed_to(gateway, generation_id: str) -> str:
    routes = [e["worker_id"] for e in gateway.events_named("request_routed") if e["generation_id"] == generation_id]
    assert len(routes) == 1, gateway.log_tail()
    return routes[0]


async def test_a_next_turn_lands_on_the_worker_holding_the_conversation_and_a_request_on_the_free_one(
    kafka_bootstrap, topic_prefix, spawn
):
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    workers = [spawn("worker", *kafka, "--worker-id", f"w{i}", "--max-batch-size", "1") for i in range(2)]
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, MODEL, [*workers, gateway])
    while not all(w.events_named("worker_started") for w in workers):
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # both workers' load reports
    async with httpx.AsyncClient(timeout=60) as client:
        # Two conversations at once: each worker's one slot takes one.
        # Each long enough past the shared system prompt to fill prompt pieces of its own (bus/prefixes.py).
        first_turns = [SYSTEM + "Who was Augustus? " * 30, SYSTEM + "Who was Nero? " * 40]
        answers = await asyncio.gather(*(_generate(client, base, text, 40) for text in first_turns))
        served = [_routed_to(gateway, answer["id"]) for answer in answers]
        assert sorted(served) == ["w0", "w1"]
        # Each next turn, alone on an idle fleet, goes where its conversation is cached, whichever that is.
        for text, answer, worker in reversed(list(zip(first_turns, answers, served, strict=True))):
            follow_up = await _generate(client, base, text + answer["text_output"] + " And after him?", 8)
            assert _routed_to(gateway, follow_up["id"]) == worker

        # One worker busy with a long request: the next one goes to the free worker and ends first.
        long = asyncio.create_task(_generate(client, base, "The following example", 400))  # 400 greedy tokens
        while not gateway.events_named("request_routed")[4:]:
            await asyncio.sleep(0.05)
        # Routes follow load reports, which come within 100 ms of a change: let the other worker report that
        # its follow-up ended, and this one that it runs the long request (it runs for seconds).
        await asyncio.sleep(0.5)
        short = await _generate(client, base, "A short question?", 4)
        assert not long.done()
        busy = _routed_to(gateway, (await long)["id"])
        assert _routed_to(gateway, short["id"]) != busy


async def _stream(client: httpx.AsyncClient, url: str, body: dict, events: list[dict]) -> None:
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))


async def test_stop_infer_on_another_gateway_stops_the_request_where_it_runs(kafka_bootstrap, topic_prefix, spawn):
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    # A simulated worker: it starts at once and never ends a stream early with EOS.
    metrics = f"127.0.0.1:{free_port()}"
    worker = spawn(
        "worker", *kafka, "--simulate", "bundled-cpu", "--served-model-name", MODEL, "--metrics-address", metrics
    )
    ports = [free_port(), free_port()]
    gateways = [spawn("gateway", "--port", str(port), *kafka) for port in ports]
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    for base in bases:
        wait_ready(base, MODEL, [worker, *gateways])
    body = {
        "id": "client-7",
        "text_input": "Once upon a time",
        "parameters": {"max_new_tokens": 500, "details": True},
    }
    events: list[dict] = []
    async with httpx.AsyncClient(timeout=60) as client:
        stream = asyncio.create_task(_stream(client, f"{bases[0]}/v2/models/{MODEL}/generate_stream", body, events))
        while len(events) < 3:
            await asyncio.sleep(0.02)
        unknown = await client.post(f"{bases[1]}/v2/models/{MODEL}/stopInfer", json={"id": "nobody"})
        assert unknown.status_code == 404
        stopped = await client.post(f"{bases[1]}/v2/models/{MODEL}/stopInfer", json={"id": "client-7"})
        assert stopped.status_code == 200, stopped.text
        await asyncio.wait_for(stream, 10)
        scraped = (await client.get(f"http://{metrics}/metrics")).text
    last = events[-1]["details"]
    assert last["finish_reason"] == "stop_sequence" and last["generated_tokens"] < 500
    # Within a step of the cancel reaching the worker: what the worker computed after it came, as it counts them
    # (the client may still get a few more tokens that were on the bus already).
    assert metric(scraped, "tokenrelay_worker_tokens_after_cancel_total", model=MODEL) <= 1
    assert metric(scraped, "tokenrelay_worker_cancellations_total", model=MODEL, reason="stop_infer") == 1
