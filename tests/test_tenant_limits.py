"""Tenants on the real broker: a tokens-per-minute limit held by two gateways together, each API's 429 with
OpenAI's headers, the limit's recovery; the tenants file read again with a stream in flight; a tenant's models,
priority and max_tokens allowance."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import SIMULATED, Process, free_port, metric, usage_of, wait_ready

pytestmark = pytest.mark.timeout(240)

MODEL = "tokenrelay-tiny"
WINDOW_S = 6
TOKENS_PER_MINUTE = 10_000  # 1,000 tokens per 6 s window
OUTPUT_TOKENS = 100  # per request: half a second or so at a simulated step's few ms
TENANTS = f"""
rate_window_s = {WINDOW_S}
[tenants.metered]
keys = ["key-metered"]
tokens_per_minute = {TOKENS_PER_MINUTE}
[tenants.other]
keys = ["key-other"]
"""


def _tenants_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def _start(spawn, kafka_bootstrap: str, topic_prefix: str, tenants: Path, gateways: int) -> list[tuple[str, Process]]:
    """A simulated worker and `gateways` gateways with the tenants file: their base URLs and processes, ready."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    worker = spawn("worker", *kafka, *SIMULATED, "--max-batch-size", "8")
    started = []
    for _ in range(gateways):
        port = free_port()
        gateway = spawn("gateway", "--port", str(port), *kafka, "--tenants-file", str(tenants))
        started.append((f"http://127.0.0.1:{port}", gateway))
    for url, _ in started:
        wait_ready(url, MODEL, [worker, *(process for _, process in started)])
    return started


def _completion(key: str, tokens: int = OUTPUT_TOKENS) -> dict:
    return {"headers": {"Authorization": f"Bearer {key}"}, "json": _completion_body(tokens)}


def _completion_body(tokens: int) -> dict:
    return {"model": MODEL, "prompt": "The following example", "max_tokens": tokens, "ignore_eos": True}


async def test_two_gateways_hold_a_tokens_per_minute_limit_together_then_it_recovers(
    spawn, kafka_bootstrap, topic_prefix, tmp_path
):
    (one, _), (two, _) = _start(spawn, kafka_bootstrap, topic_prefix, _tenants_file(tmp_path, TENANTS), gateways=2)
    allowed = TOKENS_PER_MINUTE * WINDOW_S // 60
    served: dict[str, int] = {one: 0, two: 0}
    per_request: set[int] = set()
    refusals: list[httpx.Response] = []

    async def until_refused(client: httpx.AsyncClient, base: str) -> None:
        """Requests one after another through one gateway, until it refuses one."""
        while True:
            response = await client.post(f"{base}/v1/completions", **_completion("key-metered"))
            if response.status_code == 429:
                refusals.append(response)
                return
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            served[base] += usage["total_tokens"]
            per_request.add(usage["total_tokens"])

    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        await asyncio.gather(until_refused(client, one), until_refused(client, two))
        assert time.monotonic() - started < WINDOW_S  # all of it in one window
        other = await client.post(f"{one}/v1/completions", **_completion("key-other", 4))
        native = await client.post(
            f"{two}/v2/models/{MODEL}/generate",
            headers={"Authorization": "Bearer key-metered"},
            json={"text_input": "x", "parameters": {"max_new_tokens": 4}},
        )
        (size,) = per_request  # every request the same: its prompt and OUTPUT_TOKENS
        total = sum(served.values())
        # The stated bound: past the limit by the requests in flight when it is reached (one per gateway here)
        # and what the other gateway's requests were given since its last report (at most one request, which
        # lasts longer than a sharing interval): three requests.
        assert allowed <= total <= allowed + 3 * size, (total, served)
        assert served[one] and served[two]  # both gateways took part

        for refused in [*refusals, native]:
            assert refused.status_code == 429
            assert refused.headers["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
            assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
            assert refused.headers["x-ratelimit-reset-tokens"].endswith("s")
            assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
            assert "x-ratelimit-limit-requests" not in refused.headers  # no such limit for the tenant
        assert refusals[0].json()["error"]["code"] == "Too Many Requests"  # OpenAI's shape on /v1
        assert "its limit of 10000 per minute" in refusals[0].json()["error"]["message"]
        assert native.json()["error_type"] == "Too Many Requests"  # the contract's shape on /v2
        assert other.status_code == 200 and "x-ratelimit-limit-tokens" not in other.headers  # another tenant

        # OpenAI's own client sees a RateLimitError carrying the headers.
        sdk = openai.AsyncOpenAI(base_url=f"{one}/v1", api_key="key-metered", max_retries=0)
        with pytest.raises(openai.RateLimitError) as rate_limited:
            await sdk.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert rate_limited.value.response.headers["x-ratelimit-remaining-tokens"] == "0"

        # The window slides past the use: a request is admitted again within a window of the last one counted,
        # the client waiting as each refusal's Retry-After says (a refusal's wait is from the use known then:
        # requests still running, and reports still on their way, may add to it).
        deadline, refused = time.monotonic() + WINDOW_S + 1, native
        while True:
            await asyncio.sleep(int(refused.headers["retry-after"]))
            recovered = await client.post(f"{two}/v1/completions", **_completion("key-metered", 4))
            if recovered.status_code != 429 or time.monotonic() > deadline:
                break
            refused = recovered
        assert recovered.status_code == 200, recovered.text
        assert int(recovered.headers["x-ratelimit-remaining-tokens"]) > 0

    for base in (one, two):  # each gateway's tenant counters: its own requests' tokens, as the clients got them
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert metric(text, "tokenrelay_gateway_tenant_requests_total", tenant="metered", outcome="tokens_per_minute")
    counted = [
        metric(httpx.get(f"{b}/metrics", timeout=10).text, "tokenrelay_gateway_tenant_tokens_total", tenant="metered")
        for b in (one, two)
    ]
    assert sum(counted) == total + recovered.json()["usage"]["total_tokens"]  # none for a refused request


async def test_the_tenants_file_read_again_admits_a_new_key_refuses_a_removed_one_and_loses_no_stream(
    spawn, kafka_bootstrap, topic_prefix, tmp_path
):
    tenants = _tenants_file(
        tmp_path,
        """
[tenants.leaving]
keys = ["key-leaving"]
[tenants.narrow]
keys = ["key-narrow"]
models = ["some-other-model"]
[tenants.capped]
keys = ["key-capped"]
max_priority = 3
max_tokens = 8
""",
    )
    ((base, gateway),) = _start(spawn, kafka_bootstrap, topic_prefix, tenants, gateways=1)
    stream_url = f"{base}/v2/models/{MODEL}/generate_stream"
    async with httpx.AsyncClient(timeout=60) as client:
        capped = await client.post(
            f"{base}/v2/models/{MODEL}/generate",
            headers={"Authorization": "Bearer key-capped"},
            json={"text_input": "x", "parameters": {"max_new_tokens": 50, "priority": 1, "details": True}},
        )
        narrow = await client.post(f"{base}/v1/completions", **_completion("key-narrow", 4))
        events: list[str] = []

        async def stream() -> int:
            body = {"text_input": "The following example", "parameters": {"max_new_tokens": 300}}
            headers = {"Authorization": "Bearer key-leaving"}
            async with client.stream("POST", stream_url, json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                return response.status_code

        streaming = asyncio.create_task(stream())
        while not events:
            await asyncio.sleep(0.02)
        tenants.write_text('[tenants.late]\nkeys = ["key-late"]\n[tenants.capped]\nkeys = ["key-capped"]\n')
        gateway.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not gateway.events_named("tenants_reloaded"):
            assert time.monotonic() < deadline, gateway.log_tail()
            await asyncio.sleep(0.05)
        late = await client.post(f"{base}/v1/completions", **_completion("key-late", 4))
        gone = await client.post(f"{base}/v1/completions", **_completion("key-leaving", 4))
        assert await streaming == 200
    assert capped.status_code == 200 and capped.json()["details"]["generated_tokens"] == 8, capped.text
    (lowered_tokens,) = gateway.events_named("max_tokens_lowered")
    assert (lowered_tokens["tenant"], lowered_tokens["asked"], lowered_tokens["max_tokens"]) == ("capped", 50, 8)
    lowered = gateway.events_named("priority_lowered")
    assert [(e["tenant"], e["asked"], e["priority"]) for e in lowered] == [("capped", 1, 3)]
    assert narrow.status_code == 403
    assert narrow.json()["error"]["message"] == (
        f"tenant narrow may not use model {MODEL}; it may use some-other-model"
    )
    reloaded = gateway.events_named("tenants_reloaded")[0]
    assert (reloaded["added"], reloaded["removed"]) == (["late"], ["leaving", "narrow"])
    assert late.status_code == 200 and gone.status_code == 401
    assert len(events) == 300  # the stream of the removed tenant's key ran to its end
    # Each request's use, on the usage topic under its tenant and key: the capped one's 8 tokens, the stream's 300.
    rows = {row["tenant"]: row for row in usage_of(kafka_bootstrap, topic_prefix)["rows"]}
    assert sorted(rows) == ["capped", "late", "leaving"]  # the narrow tenant's request was refused: not served
    assert (rows["capped"]["finished"], rows["capped"]["output_tokens"]) == (1, 8)
    assert (rows["leaving"]["finished"], rows["leaving"]["output_tokens"]) == (1, 300)
    assert (rows["late"]["finished"], rows["late"]["output_tokens"]) == (1, 4)
