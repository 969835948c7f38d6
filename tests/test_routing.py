"""Routing on a real Kafka broker with real workers: cache, room, LoRA adapters' placement, stopInfer anywhere."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.processes import SIMULATED, free_port, metric, wait_ready
from workers.bundled import BUNDLED_ADAPTERS

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


async def test_an_adapters_requests_go_where_it_is_resident_until_it_is_busy_then_spill(
    kafka_bootstrap, topic_prefix, spawn
):
    """Two workers of one device slot each, two adapters. The first request of `shout` loads it on one worker;
    `code` then goes to the other, whose slot is free, rather than evict shout's only copy; each adapter's next
    requests go to its own worker (so neither loads again), until more shout requests come than its worker has
    room for: they wait for it as long as a load is worth, then spill onto the other worker, which loads shout.
    The workers are simulated (the real worker and engine, device slots included, around step times)."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    lora = [f"--lora=shout={BUNDLED_ADAPTERS['shout']}", f"--lora=code={BUNDLED_ADAPTERS['code']}", "--max-loras=1"]
    worker = ("worker", *kafka, *SIMULATED, *lora, "--max-batch-size", "2")
    workers = [spawn(*worker, "--worker-id", f"w{i}") for i in range(2)]
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, MODEL, [*workers, gateway])
    await asyncio.sleep(1.5)  # both workers' load reports

    async def generate(adapter: str, seed: int, tokens: int) -> str:
        """The worker the request was routed to."""
        body = {"text_input": SYSTEM, "parameters": {"max_new_tokens": tokens, "seed": seed + 1, "do_sample": True}}
        response = await client.post(f"{base}/v2/models/{adapter}/generate", json=body)
        assert response.status_code == 200, response.text
        return _routed_to(gateway, response.json()["id"])

    def loads() -> dict[tuple[str, str], int]:
        """(worker, adapter) -> the adapter's loads into that worker's device slot, so far."""
        counted: dict[tuple[str, str], int] = {}
        for process in workers:
            for event in process.events_named("adapter_loaded"):
                key = (event["worker_id"], event["adapter"])
                counted[key] = counted.get(key, 0) + 1
        return counted

    async with httpx.AsyncClient(timeout=60) as client:
        shout_worker = await generate("shout", 0, 4)
        await asyncio.sleep(1.0)  # its report (shout resident there) reaches the gateway: 0.1 s when idle
        code_worker = await generate("code", 1, 4)
        assert code_worker != shout_worker  # a free slot rather than the slot of shout's only copy
        await asyncio.sleep(1.0)
        for seed in range(2, 8):  # one at a time: each goes where its adapter is, though both workers are idle
            assert await generate(("shout", "code")[seed % 2], seed, 4) == (shout_worker, code_worker)[seed % 2]
        assert loads() == {(shout_worker, "shout"): 1, (code_worker, "code"): 1}

        # More shout requests at once than its worker has room for (2 running, 1 read ahead): the rest spill.
        burst = await asyncio.gather(*(generate("shout", 100 + i, 300) for i in range(8)))
        assert set(burst) == {shout_worker, code_worker}, burst
        assert burst.count(shout_worker) >= 3, burst
        assert loads()[code_worker, "shout"] == 1, loads()


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
