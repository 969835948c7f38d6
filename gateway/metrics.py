"""The gateway's Prometheus metrics, served at GET /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from gateway.inflight import InFlight

REQUESTS = Counter(
    "tokenrelay_requests_total",
    "Generation requests this gateway answered, by model and how they ended "
    "(a finish_reason, an error_type, or 'client gone').",
    ["model", "outcome"],
)
GENERATED_TOKENS = Counter(
    "tokenrelay_generated_tokens_total", "Tokens generated for requests this gateway answered.", ["model"]
)
IN_FLIGHT = Gauge("tokenrelay_requests_in_flight", "Requests this gateway is waiting for.", ["model"])


def started(inflight: InFlight) -> None:
    IN_FLIGHT.labels(inflight.request.model).inc()


def ended(inflight: InFlight) -> None:
    model = inflight.request.model
    IN_FLIGHT.labels(model).dec()
    REQUESTS.labels(model, inflight.outcome or "client gone").inc()
    GENERATED_TOKENS.labels(model).inc(inflight.generated_tokens)
