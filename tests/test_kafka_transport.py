"""Priority, deadlines, cancellation and back-pressure, end to end on a real Kafka broker.

Each test starts its own gateway and worker (topics of their own) with the
worker settings it needs, and drives them over HTTP on loopback. The worker is
the real worker and engine around the bundled model's stand-in (SIMULATED: its
measured step times, tokens from each request's seed): what is tested is how
requests and tokens travel, which a test's load would otherwise pay for in
CPU that the machine's other tests need. Bounds are
generous where a slow machine could miss them; the orders of magnitude asserted
are the point (a priority-1 request waits a small fraction of what priority 5 does).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

import httpx
import pytest

from tests.processes import SIMULATED, Process, free_port, metric, on_kafka, spawn_tokenrelay, wait_ready

pytestmark = pytest.mark.kafka

MODEL = "tokenrelay-tiny"
LONG_PROMPT = "The following example"  # greedy: hundreds of tokens before any EOS


def _body(max_new_tokens: int, **parameters) -> dict:
    return {"text_input": LONG_PROMPT, "parameters": {"max_new_tokens": max_new_tokens, **parameters}}


class _Stream:
    """One generate_stream as the client sees it: when it was sent, when each event came."""

    def __init__(self) -> None:
        self.sent_at = time.monotonic()
        self.event_times: list[float] = []
        self.events: list[dict] = []
        self.status: int | None = None

    @property
    def time_to_first_event(self) -> float:
        return self.event_times[0] - self.sent_at

    async def run(self, client: httpx.AsyncClient, url: str, body: dict, stop_after: int | None = None) -> _Stream:
        async with client.stream("POST", url, json=body) as response:
            self.status = response.status_code
            if response.status_code != 200:
                self.events.append(json.loads(await response.aread()))
                return self
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    self.event_times.append(time.monotonic())
                    self.events.append(json.loads(line[len("data:") :]))
                    if stop_after is not None and len(self.events) >= stop_after:
                        return self  # leaving the block closes the connection mid-stream
        return self


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10), limits=httpx.Limits(max_connections=None))


def _metric(base_url: str, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{base_url}/metrics", timeout=10).text, name, **labels)


async def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _routed(gateway) -> list[dict]:
    return gateway.process.events_named("request_routed")


async def _until_routed(client: httpx.AsyncClient, gateway) -> int:
    """Send small requests until one is routed to a worker's inbox: the gateway's router has heard the worker's
    load (a request sent between the worker's heartbeat, which makes the model ready, and its first load report
    reaching the router goes to the shared queue). The requests routed so far."""
    url = gateway.url(f"/v2/models/{MODEL}/generate")
    deadline = time.monotonic() + 30
    while not _routed(gateway):
        assert time.monotonic() < deadline, f"no request was routed: {gateway.process.log_tail()}"
        assert (await client.post(url, json=_body(1))).status_code == 200
    return len(_routed(gateway))


async def test_urgent_streams_overtake_200_background_streams_on_a_saturated_worker(kafka_bootstrap, tmp_path):
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=(*SIMULATED, "--max-batch-size", "16")) as (gateway, worker):
        url = gateway.url(f"/v2/models/{MODEL}/generate_stream")
        async with _client() as client:
            # 160 tokens each: at a simulated step's few ms, a background wave lasts about a second, long beside
            # what the HTTP and Kafka hops cost an urgent request on a busy machine.
            background = [_Stream() for _ in range(200)]
            running = [asyncio.create_task(s.run(client, url, _body(160, priority=5))) for s in background]
            while sum(bool(s.event_times) for s in background) < 16:  # the worker is full
                await asyncio.sleep(0.05)
            urgent = [_Stream() for _ in range(20)]
            running += [asyncio.create_task(s.run(client, url, _body(160, priority=1))) for s in urgent]
            await asyncio.wait_for(asyncio.gather(*running), timeout=240)
    for stream in background + urgent:
        assert stream.status == 200 and len(stream.events) == 160, stream.events[-1:]
    background_median = statistics.median(s.time_to_first_event for s in background)
    urgent_median = statistics.median(s.time_to_first_event for s in urgent)
    assert urgent_median < background_median / 10, (urgent_median, background_median)


async def test_a_request_past_its_timeout_ends_with_the_documented_error_and_frees_its_slot(kafka_bootstrap, tmp_path):
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=(*SIMULATED, "--max-batch-size", "2")) as (gateway, worker):
        stream_url = gateway.url(f"/v2/models/{MODEL}/generate_stream")
        async with _client() as client:
            started = time.monotonic()
            # Both slots go to requests of 400 tokens (~10 s here) that may take 1 s.
            limits = {"max_new_tokens": 400, "timeout": 1, "priority": 5}
            non_stream = asyncio.create_task(
                client.post(
                    gateway.url(f"/v2/models/{MODEL}/generate"), json={"text_input": LONG_PROMPT, "parameters": limits}
                )
            )
            timed_stream = asyncio.create_task(_Stream().run(client, stream_url, _body(400, timeout=1)))
            await asyncio.sleep(0.5)
            waiting = _Stream()
            next_in_line = asyncio.create_task(waiting.run(client, stream_url, _body(8)))
            response = await non_stream
            answered_after = time.monotonic() - started
            stream = await timed_stream
            await next_in_line
    assert response.status_code == 504, response.text
    assert response.json() == {"error": response.json()["error"], "error_type": "Timeout"}
    assert "timeout" in response.json()["error"]
    assert answered_after < 1.5
    assert stream.status == 200 and stream.events[-1]["error_type"] == "Timeout"
    assert set(stream.events[-1]) == {"error", "error_type"} and len(stream.events) > 1  # tokens, then the error
    assert stream.event_times[-1] - started < 1.5
    # The waiting request got a slot when the expired ones left, long before 400 tokens would have ended.
    assert len(waiting.events) == 8 and 0.9 < waiting.event_times[0] - started < 3.0
    finished = {e["request_id"]: e["finish_reason"] for e in worker.events_named("request_finished")}
    assert list(finished.values()).count("stop_sequence") == 2


def _admitted(worker: Process) -> int:
    return len(worker.events_named("request_admitted"))


async def test_a_client_that_leaves_costs_at_most_one_more_step_and_a_cancelled_queued_request_never_runs(
    kafka_bootstrap, tmp_path
):
    metrics_port = free_port()
    worker_metrics = f"http://127.0.0.1:{metrics_port}"
    # --max-iter-times: the busy request must outlast the 2 s before its stopInfer, at a few ms a token.
    worker_args = (
        *SIMULATED,
        "--max-batch-size",
        "1",
        "--max-iter-times",
        "2000",
        "--metrics-address",
        f"127.0.0.1:{metrics_port}",
    )
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=worker_args) as (gateway, worker):
        stream_url = gateway.url(f"/v2/models/{MODEL}/generate_stream")
        async with _client() as client:
            # 1. A stream whose client leaves after 5 tokens.
            left = await _Stream().run(client, stream_url, _body(400), stop_after=5)
            assert len(left.events) == 5
            await _wait_for(lambda: worker.events_named("request_finished"), 10, "the worker to end the stream")
            [ended] = worker.events_named("request_finished")
            assert ended["finish_reason"] == "stop_sequence" and ended["generated_tokens"] < 400
            cancelled = _metric(
                worker_metrics, "tokenrelay_worker_cancellations_total", model=MODEL, reason="client_gone"
            )
            assert cancelled == 1
            assert _metric(worker_metrics, "tokenrelay_worker_tokens_after_cancel_total", model=MODEL) <= 1

            # 2. The one slot is busy; a queued stream's client leaves before its first token.
            busy = asyncio.create_task(_Stream().run(client, stream_url, {**_body(2000), "id": "busy"}))
            await _wait_for(lambda: _admitted(worker) == 2, 10, "the busy request to start")
            queued = asyncio.create_task(_Stream().run(client, stream_url, _body(400)))
            await asyncio.sleep(1.0)
            queued.cancel()  # the client goes away while its request waits in the topic
            await asyncio.gather(queued, return_exceptions=True)
            await asyncio.sleep(1.0)  # the gateway notices (polls every 0.1 s) and publishes the cancel
            stopped = await client.post(gateway.url(f"/v2/models/{MODEL}/stopInfer"), json={"id": "busy"})
            assert stopped.status_code == 200
            busy_stream = await busy
            assert busy_stream.status == 200 and 0 < len(busy_stream.events) < 2000  # stopped early
            await _wait_for(lambda: worker.events_named("request_skipped"), 10, "the cancelled request to be skipped")
    [skipped] = worker.events_named("request_skipped")
    assert skipped["reason"] == "client gone"  # the reason of the cancel that was waiting for it
    assert _admitted(worker) == 2  # the queued request never ran


async def test_past_its_in_flight_limit_a_gateway_answers_429_with_retry_after(kafka_bootstrap, tmp_path):
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=SIMULATED, gateway_args=("--max-in-flight", "2")) as (
        gateway,
        worker,
    ):
        stream_url = gateway.url(f"/v2/models/{MODEL}/generate_stream")
        async with _client() as client:
            first, second = _Stream(), _Stream()  # 500 tokens: seconds, at a simulated step's few ms
            streams = [asyncio.create_task(s.run(client, stream_url, _body(500))) for s in (first, second)]
            await _wait_for(lambda: first.event_times and second.event_times, 60, "both streams' first events")
            refused = await client.post(gateway.url(f"/v2/models/{MODEL}/generate"), json=_body(4))
            await asyncio.gather(*streams)
            accepted = await client.post(gateway.url(f"/v2/models/{MODEL}/generate"), json=_body(4))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error_type"] == "Too Many Requests" and "--max-in-flight" in refused.json()["error"]
    assert accepted.status_code == 200


async def test_past_the_waiting_limit_a_request_no_worker_has_room_for_gets_429_at_once(kafka_bootstrap, tmp_path):
    """One slot: a stream runs, a second waits at the worker (read ahead); with --max-waiting-requests 1, a third
    request of the same priority is refused at once, one urgent enough to preempt is taken, and once the
    streams end a request is taken again."""
    worker_args = (*SIMULATED, "--max-batch-size", "1")
    gateway_args = ("--max-waiting-requests", "1")
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=worker_args, gateway_args=gateway_args) as (gateway, _):
        stream_url = gateway.url(f"/v2/models/{MODEL}/generate_stream")
        async with _client() as client:
            routed = await _until_routed(client, gateway)
            # The worker's report that the warm-up ended (within 0.1 s of it): until it comes, the router counts
            # the warm-up as running and the first stream as unread, no room for the second, which is refused.
            await asyncio.sleep(1.0)
            running, waiting = _Stream(), _Stream()  # 500 tokens: seconds, at a simulated step's few ms
            streams = [asyncio.create_task(running.run(client, stream_url, _body(500)))]
            await _wait_for(lambda: running.event_times, 60, "the first stream's first event")
            streams.append(asyncio.create_task(waiting.run(client, stream_url, _body(500))))
            await _wait_for(lambda: len(_routed(gateway)) == routed + 2, 60, "both streams to be routed")
            refused = await client.post(gateway.url(f"/v2/models/{MODEL}/generate"), json=_body(4))
            urgent = await client.post(gateway.url(f"/v2/models/{MODEL}/generate"), json=_body(4, priority=1))
            await asyncio.gather(*streams)
            accepted = await client.post(gateway.url(f"/v2/models/{MODEL}/generate"), json=_body(4))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {
        "error": f"model {MODEL} already has 1 requests waiting for a worker, its limit (--max-waiting-requests)",
        "error_type": "Too Many Requests",
    }
    assert urgent.status_code == 200 and accepted.status_code == 200, (urgent.text, accepted.text)
    assert len(running.events) == len(waiting.events) == 500


async def test_a_gateway_that_dies_mid_stream_frees_the_workers_slots_within_10_s(kafka_bootstrap, tmp_path):
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", f"t{uuid.uuid4().hex[:10]}"]
    port = free_port()
    # 8 x 4000 tokens: longer than the 10 s allowed, at a few ms a step
    worker = spawn_tokenrelay(["worker", *kafka, *SIMULATED, "--max-iter-times", "4000"], tmp_path / "worker.log")
    gateway = spawn_tokenrelay(["gateway", "--port", str(port), *kafka], tmp_path / "gateway.log")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, MODEL, [worker, gateway])
        url = f"{base_url}/v2/models/{MODEL}/generate_stream"
        async with _client() as client:
            streams = [_Stream() for _ in range(8)]
            running = [asyncio.create_task(s.run(client, url, _body(4000))) for s in streams]
            await _wait_for(lambda: all(s.event_times for s in streams), 60, "every stream's first event")
            gateway.popen.kill()  # no goodbye: its heartbeats just stop
            killed_at = time.monotonic()
            await asyncio.gather(*running, return_exceptions=True)
            await _wait_for(lambda: len(worker.events_named("request_finished")) == 8, 10, "the slots to be freed")
        assert time.monotonic() - killed_at < 10
        finished = worker.events_named("request_finished")
        assert all(f["finish_reason"] == "stop_sequence" and f["generated_tokens"] < 4000 for f in finished)
        assert {c["reason"] for c in worker.events_named("request_cancel_received")} == {"gateway gone"}
    finally:
        gateway.stop()
        assert worker.stop() == 0, worker.log_tail()


def test_a_request_over_kafkas_default_message_size_crosses_and_one_over_the_limit_is_413(kafka_bootstrap, tmp_path):
    limit = ("--max-message-bytes", "2000000")
    with on_kafka(tmp_path, kafka_bootstrap, worker_args=(*SIMULATED, *limit), gateway_args=limit) as (gateway, worker):
        url = f"{gateway.base_url}/v2/models/{MODEL}/generate_stream"
        # 1.5 MB of text, within the route's 4 MB: past Kafka's default 1 MB message (which the producer
        # refused with a 503 before), it reaches the worker, which finds it too long for the model (424).
        crossed = httpx.post(url, json={"text_input": "word " * 300_000}, timeout=120)
        assert crossed.status_code == 424, crossed.text
        assert "tokens after tokenization" in crossed.json()["error"]
        over = httpx.post(url, json={"text_input": "word " * 420_000}, timeout=30)  # 2.1 MB
        assert over.status_code == 413, over.text
        assert "at most 2000000 are carried" in over.json()["error"]
        assert len(worker.events_named("request_admitted")) == 1  # the one over the limit was never published
