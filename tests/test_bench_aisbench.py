"""`bench serve`'s AISBench figures (tokenrelay/bench/aisbench.py) on fixed request timings: the very numbers that
AISBench 3.1's own calculator (DefaultPerfMetricCalculator) gives for the same timings."""

from __future__ import annotations

from tokenrelay.bench.aisbench import line, metrics, span
from tokenrelay.bench.load import Outcome

# Sent at, stream events' arrivals, each token's arrival (two came in one event), prompt tokens; one failed.
OUTCOMES = [
    Outcome(sent_at=0.0, event_times=[0.1, 0.2, 0.4], token_times=[0.1, 0.2, 0.2, 0.4], prompt_tokens=10),
    Outcome(sent_at=0.05, event_times=[0.25, 0.35], token_times=[0.25, 0.35], prompt_tokens=20),
    Outcome(sent_at=0.1, event_times=[0.5], token_times=[0.5], prompt_tokens=30),
    Outcome(sent_at=0.2, error="HTTP 503", prompt_tokens=40),
]


def _stats(average, low, high, median, p75, p90, p99, n) -> dict:
    return {"Average": average, "Min": low, "Max": high, "Median": median, "P75": p75, "P90": p90, "P99": p99, "N": n}


def test_the_metrics_are_aisbenchs_on_the_same_timings():
    assert span(OUTCOMES) == 0.5  # the last event (0.5) after the first sending (0.0) of the requests that succeeded
    figures = metrics(OUTCOMES, span(OUTCOMES), max_concurrency=3)
    assert figures == {
        "E2EL": _stats(366.7, 300.0, 400.0, 400.0, 400.0, 400.0, 400.0, 3),
        "TTFT": _stats(233.3, 100.0, 400.0, 200.0, 300.0, 360.0, 396.0, 3),
        # (E2EL - TTFT) / (output tokens - 1): 300 / 3, 100 / 1, and 0 for the one-token answer
        "TPOT": _stats(66.7, 0.0, 100.0, 100.0, 100.0, 100.0, 100.0, 2),
        "ITL": _stats(133.3, 100.0, 200.0, 100.0, 150.0, 180.0, 198.0, 2),  # between events, not tokens
        "InputTokens": _stats(20.0, 10.0, 30.0, 20.0, 25.0, 28.0, 29.8, 3),
        "OutputTokens": _stats(2.3333, 1.0, 4.0, 2.0, 3.0, 3.6, 3.96, 3),
        "OutputTokenThroughput": _stats(6.3889, 2.5, 10.0, 6.6667, 8.3333, 9.3333, 9.9333, 3),
        "Benchmark Duration": 500.0,
        "Total Requests": 4,
        "Failed Requests": 1,
        "Success Requests": 3,
        "Concurrency": 2.2,  # (400 + 300 + 400 ms) / 500 ms
        "Max Concurrency": 3,
        "Request Throughput": 6.0,
        "Total Input Tokens": 60,
        "Prefill Token Throughput": 85.7143,  # 60 prompt tokens / (100 + 200 + 400 ms of TTFT)
        "Total Generated Tokens": 7,
        "Input Token Throughput": 120.0,
        "Output Token Throughput": 14.0,
        "Total Token Throughput": 134.0,
    }
    assert line("server", figures) == (
        "server   AISBench (Average/P90/P99): TTFT 233.3/360.0/396.0 ms  TPOT 66.7/100.0/100.0 ms  "
        "ITL 133.3/180.0/198.0 ms  E2EL 366.7/400.0/400.0 ms  Prefill Token Throughput 85.7 token/s  "
        "Output Token Throughput 14.0 token/s  Concurrency 2.20"
    )


def test_a_load_where_nothing_succeeded_has_zeros_not_a_division_by_zero():
    failed = [Outcome(sent_at=0.0, error="HTTP 503")]
    figures = metrics(failed, span(failed), max_concurrency=1)
    assert figures["Success Requests"] == 0 and figures["Failed Requests"] == 1
    assert figures["TTFT"]["Average"] == 0.0 and figures["Concurrency"] == 0.0 and figures["Benchmark Duration"] == 0.0
