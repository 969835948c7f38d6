"""Prometheus metrics of a request's life, the same families on gateways and workers.

A gateway measures what its clients see, a worker what it produced; each
exports the families below under `tokenrelay_gateway_*` or
`tokenrelay_worker_*` (`tokenrelay serve` is both), at GET /metrics.
Latencies count from the request's arrival at the gateway (the `arrival` it
carries), so a worker's figures include the time the request spent in Kafka.
A model's failure and timeout counts are exported at 0 from the moment the
process knows the model (`count_from_zero`), not from their first event.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import structlog
from prometheus_client import Counter, Gauge, Histogram

from bus.base import Bus, BusUnavailable
from bus.topics import PRIORITIES, request_topics, worker_group
from schemas.messages import TIMEOUT, GenerationRequest, TokenEvent

log = structlog.get_logger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@functools.lru_cache(maxsize=1024)  # a few reasons and error types, met on every request's end
def snake(value: str) -> str:
    """A label value as Prometheus users write them: "Service Unavailable" is service_unavailable, "stopInfer"
    stop_infer. Error types and reasons are prose in logs and answers; in labels they are identifiers."""
    value = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", value)
    return re.sub(r"[^a-z0-9]+", "_", value.lower()).strip("_")


class RequestMetrics:
    def __init__(self, component: str) -> None:
        name = f"tokenrelay_{component}"
        by_priority = ["model", "priority"]
        self.time_to_first_token = Histogram(
            f"{name}_time_to_first_token_seconds",
            "From the request's arrival to its first token.",
            by_priority,
            buckets=_LATENCY_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            f"{name}_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
            by_priority,
            buckets=_TOKEN_GAP_BUCKETS,
        )
        self.e2e_latency = Histogram(
            f"{name}_e2e_request_latency_seconds",
            "From the request's arrival to its last event.",
            by_priority,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            f"{name}_queue_time_seconds",
            "From the request's arrival until a worker took it (time to first token less prefill).",
            by_priority,
            buckets=_LATENCY_BUCKETS,
        )
        self.running = Gauge(f"{name}_requests_running", "Requests producing tokens.", ["model"])
        self.waiting = Gauge(f"{name}_requests_waiting", "Requests waiting for their first token.", ["model"])
        self.requests = Counter(
            f"{name}_requests",
            "Requests that ended, by how: a finish_reason, an error_type or client_gone (in snake_case).",
            ["model", "priority", "outcome"],
        )
        self.generated_tokens = Counter(f"{name}_generated_tokens", "Tokens generated.", ["model"])
        self.failures = Counter(
            f"{name}_failures",
            "Requests that ended in an error, by error_type (timeouts apart).",
            ["model", "reason"],
        )
        self.cancellations = Counter(
            f"{name}_cancellations", "Requests cancelled, by why: client_gone, stop_infer, ...", ["model", "reason"]
        )
        self.timeouts = Counter(f"{name}_timeouts", "Requests that ended at their deadline.", ["model"])
        self.consumer_lag = Gauge(
            f"{name}_consumer_lag",
            "Requests in a priority topic that the workers have not acknowledged yet (waiting or running).",
            ["model", "priority"],
        )

    def count_from_zero(self, model: str, error_types: Iterable[str]) -> None:
        """Export the model's failures of these error types, and its timeouts, at 0 until they happen: a series
        born with its first event shows "No data" until then, and rate() over it misses that first one."""
        for error_type in error_types:
            self.failures.labels(model, snake(error_type))
        self.timeouts.labels(model)

    def failed(self, model: str, error_type: str) -> None:
        self.failures.labels(model, snake(error_type)).inc()

    def cancelled(self, model: str, reason: str) -> None:
        self.cancellations.labels(model, snake(reason)).inc()


@functools.cache
def metrics_of(component: str) -> RequestMetrics:
    """The process's metrics for `component` ("gateway" or "worker"), created on first use."""
    return RequestMetrics(component)


class RequestTimer:
    """One request's clocks, turned into observations as its events go by.

    Created when the request is taken on (it counts as waiting), fed every event
    as it is handed on, ended once.
    """

    def __init__(self, metrics: RequestMetrics, request: GenerationRequest) -> None:
        self._metrics = metrics
        self._model = request.model
        self._labels = (request.model, str(request.priority))
        self._arrival = request.arrival
        self._last_token_at: float | None = None
        self._ended = False
        metrics.waiting.labels(self._model).inc()

    def event(self, event: TokenEvent, now: float) -> None:
        metrics = self._metrics
        if event.token_ids:
            if self._last_token_at is None:
                time_to_first_token = now - self._arrival
                prefill_s = (event.prefill_time_ms or event.decode_time_ms or 0.0) / 1000
                metrics.time_to_first_token.labels(*self._labels).observe(time_to_first_token)
                metrics.queue_time.labels(*self._labels).observe(max(0.0, time_to_first_token - prefill_s))
                metrics.waiting.labels(self._model).dec()
                metrics.running.labels(self._model).inc()
            else:
                gap = (now - self._last_token_at) / len(event.token_ids)
                for _ in event.token_ids:
                    metrics.inter_token_latency.labels(*self._labels).observe(gap)
            self._last_token_at = now
            metrics.generated_tokens.labels(self._model).inc(len(event.token_ids))
        if event.error is not None:
            self.end(event.error.error_type, now, failed=True)
        elif event.finish_reason is not None:
            self.end(event.finish_reason.value, now)

    def end(self, outcome: str, now: float, failed: bool = False) -> None:
        """The request is over: a finish_reason, an error_type (`failed`), or e.g. 'client gone'."""
        if self._ended:
            return
        self._ended = True
        metrics = self._metrics
        (metrics.running if self._last_token_at is not None else metrics.waiting).labels(self._model).dec()
        metrics.e2e_latency.labels(*self._labels).observe(now - self._arrival)
        metrics.requests.labels(*self._labels, snake(outcome)).inc()
        if failed and outcome == TIMEOUT:
            metrics.timeouts.labels(self._model).inc()
        elif failed:
            metrics.failed(self._model, outcome)


async def record_backlog(bus: Bus, metrics: RequestMetrics, topic_prefix: str, model: str) -> None:
    """Set the consumer lag gauges of the model's priority topics (left as they were if the bus is down)."""
    topics = request_topics(topic_prefix, model)
    try:
        backlog = await bus.backlog(topics, worker_group(topic_prefix, model))
    except BusUnavailable as error:
        log.warning("backlog_not_measured", model=model, error=str(error))
        return
    for priority, topic in zip(PRIORITIES, topics, strict=True):
        metrics.consumer_lag.labels(model, str(priority)).set(backlog[topic])
