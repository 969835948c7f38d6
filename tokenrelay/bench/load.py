"""A client's load on a streaming endpoint, shared by the serving benches (serve, scale, priority, and serve's
engine topology): what each request asks, what came back and when, and the figures a run is summed up in.

The endpoints: generate_stream (SSE), /infer (MindIE's native stream) and /ws (WebSocket).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import websockets

ENDPOINTS = ("generate_stream", "infer", "ws")


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int
    prompt_tokens: int = 0  # as the bundled tokenizer encodes the prompt (0: not counted)


@dataclass
class Outcome:
    sent_at: float
    token_times: list[float] = field(default_factory=list)  # when each token arrived
    error: str | None = None
    event_times: list[float] = field(default_factory=list)  # when each stream event arrived, tokens or not
    prompt_tokens: int = 0  # the request's


def _parameters(request: Request) -> dict:
    return {"max_new_tokens": request.max_new_tokens, "do_sample": False, "seed": 1, "details": True}


async def sse(client: httpx.AsyncClient, url: str, body: dict, prefix: str) -> AsyncIterator[dict]:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if line.startswith(prefix):
                payload = line[len(prefix) :]
                if payload.strip() == "[DONE]":  # the end of an OpenAI stream
                    return
                yield json.loads(payload)


async def _events(endpoint: str, client: httpx.AsyncClient, base: str, model: str, request: Request):
    """The endpoint's stream events for one request, each as (tokens generated so far, error)."""
    if endpoint == "generate_stream":
        body = {"text_input": request.prompt, "parameters": _parameters(request)}
        async for obj in sse(client, f"{base}/v2/models/{model}/generate_stream", body, "data:"):
            yield obj.get("details", {}).get("generated_tokens"), obj.get("error")
    elif endpoint == "infer":
        body = {"inputs": request.prompt, "stream": True, "parameters": _parameters(request)}
        count = 0
        async for obj in sse(client, f"{base}/infer", body, "data: "):
            count += obj.get("token") is not None and obj["token"].get("id") is not None
            yield count, obj.get("error")
    else:
        async with websockets.connect(base.replace("http", "ws", 1) + "/ws", max_size=None) as socket:
            message = {"op": "generate_stream", "model": model, "text_input": request.prompt}
            await socket.send(json.dumps({**message, "parameters": _parameters(request)}))
            async for raw in socket:
                reply = json.loads(raw)
                if reply.get("done"):
                    return
                data = reply["data"]
                yield data.get("details", {}).get("generated_tokens"), data.get("error")


async def one_stream(endpoint: str, client: httpx.AsyncClient, base: str, model: str, request: Request) -> Outcome:
    outcome = Outcome(sent_at=time.perf_counter(), prompt_tokens=request.prompt_tokens)
    try:
        async for generated, error in _events(endpoint, client, base, model, request):
            if error:
                outcome.error = error
                break
            now = time.perf_counter()
            outcome.event_times.append(now)
            outcome.token_times.extend([now] * ((generated or 0) - len(outcome.token_times)))
    except (httpx.HTTPError, websockets.WebSocketException, RuntimeError, OSError) as failure:
        outcome.error = str(failure)
    return outcome


def load_client() -> httpx.AsyncClient:
    """A client for a load of many long streams: no connection limit, ten minutes for a request."""
    return httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=None))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "mean": round(statistics.fmean(values) * 1000, 2)}


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    done = [o for o in outcomes if o.error is None and o.token_times]
    tokens = sum(len(o.token_times) for o in done)
    ttft = [o.token_times[0] - o.sent_at for o in done]
    tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in done if len(o.token_times) > 1]
    itl = [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    e2e = [o.token_times[-1] - o.sent_at for o in done]
    errors = sorted({o.error for o in outcomes if o.error is not None})
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": errors[:5],
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(done) / duration_s, 3),
        "output_tokens": tokens,
        "output_token_throughput": round(tokens / duration_s, 1),
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
    }
