"""AISBench's performance metrics of a load, by AISBench's own definitions and under its names.

AISBench (PyPI `ais-bench-benchmark`) is the benchmark MindIE's documents
point to; a MindIE user compares its numbers. Its definitions, from 3.1's
summarizers/default_perf.py and calculators/base_perf_metric_calculator.py:
a request's time points are its sending and the arrival of each stream
event, and

- E2EL = last event - sending; TTFT = first event - sending;
- TPOT = (E2EL - TTFT) / (output tokens - 1), 0 for a one-token answer;
- ITL = the gaps between consecutive events;
- OutputTokenThroughput (per request) = output tokens / E2EL;

each summed up as Average, Min, Max, Median, P75, P90 and P99 (numpy's
linear percentiles) over the requests that succeeded, with N their count
(for TPOT and ITL: those with more than one event). Over the run:

- Benchmark Duration = last event of any request - first sending;
- Concurrency = sum of E2EL / Benchmark Duration;
- Request, Input, Output and Total Token Throughput: per Benchmark Duration;
- Prefill Token Throughput = input tokens / sum of TTFT.

Times are in milliseconds, throughputs per second, each rounded as AISBench
rounds them (to 4 decimals of a second for a time). Input tokens are the
prompt's tokens as the bundled tokenizer encodes them (AISBench's own count
when a service returns none); output tokens, those the server says it
generated (AISBench tokenizes the text, which an EOS token adds nothing to).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tokenrelay.bench.load import Outcome

STATISTICS = ("Average", "Min", "Max", "Median", "P75", "P90", "P99")


def statistics_of(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """AISBench's statistics of `values` (times `scale`); zeros when there are none, as AISBench gives."""
    if not values:
        return dict.fromkeys(STATISTICS, 0.0)
    # numpy's default (linear) percentiles are statistics' inclusive quantiles; one value is every quantile
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    figures = {
        "Average": statistics.fmean(values),
        "Min": min(values),
        "Max": max(values),
        "Median": statistics.median(values),
        "P75": cuts[74],
        "P90": cuts[89],
        "P99": cuts[98],
    }
    # Rounded as AISBench rounds: to 4 decimals in seconds (or tokens), then scaled
    return {name: round(round(value, 4) * scale, 4) for name, value in figures.items()}


def metrics(outcomes: Sequence[Outcome], duration_s: float, max_concurrency: int) -> dict:
    """AISBench's per-request metrics and common metrics of the load. `duration_s`: the Benchmark Duration, as
    `span` gives it for one run (the sum of each run's, for runs that took turns)."""
    done = [o for o in outcomes if o.error is None and o.event_times]
    e2el = [o.event_times[-1] - o.sent_at for o in done]
    ttft = [o.event_times[0] - o.sent_at for o in done]
    output = [len(o.token_times) for o in done]
    tpot = [(e - t) / (n - 1) if n > 1 else 0.0 for e, t, n in zip(e2el, ttft, output, strict=True)]
    itl = [b - a for o in done for a, b in zip(o.event_times, o.event_times[1:], strict=False)]
    decoded = sum(len(o.event_times) > 1 for o in done)
    inputs = [o.prompt_tokens for o in done]
    per_request = {
        "E2EL": {**statistics_of(e2el, 1000), "N": len(done)},
        "TTFT": {**statistics_of(ttft, 1000), "N": len(done)},
        "TPOT": {**statistics_of(tpot, 1000), "N": decoded},
        "ITL": {**statistics_of(itl, 1000), "N": decoded},
        "InputTokens": {**statistics_of(inputs), "N": len(done)},
        "OutputTokens": {**statistics_of(output), "N": len(done)},
        "OutputTokenThroughput": {**statistics_of([n / e for n, e in zip(output, e2el, strict=True)]), "N": len(done)},
    }
    per_second = 1 / duration_s if duration_s > 0 else 0.0
    common = {
        "Benchmark Duration": round(duration_s * 1000, 4),
        "Total Requests": len(outcomes),
        "Failed Requests": len(outcomes) - len(done),
        "Success Requests": len(done),
        "Concurrency": round(sum(e2el) * per_second, 4),
        "Max Concurrency": max_concurrency,
        "Request Throughput": round(len(done) * per_second, 4),
        "Total Input Tokens": sum(inputs),
        "Prefill Token Throughput": round(sum(inputs) / sum(ttft), 4) if sum(inputs) and sum(ttft) else 0.0,
        "Total Generated Tokens": sum(output),
        "Input Token Throughput": round(sum(inputs) * per_second, 4),
        "Output Token Throughput": round(sum(output) * per_second, 4),
        "Total Token Throughput": round((sum(inputs) + sum(output)) * per_second, 4),
    }
    return {**per_request, **common}


def span(outcomes: Sequence[Outcome]) -> float:
    """AISBench's Benchmark Duration of one run, in seconds: its last event after its first sending, over the
    requests that succeeded."""
    done = [o for o in outcomes if o.error is None and o.event_times]
    return max(o.event_times[-1] for o in done) - min(o.sent_at for o in done) if done else 0.0


def line(name: str, figures: dict) -> str:
    """The figures as a line of the printed table, in AISBench's names."""
    shown = "  ".join(
        f"{metric} {figures[metric]['Average']:.1f}/{figures[metric]['P90']:.1f}/{figures[metric]['P99']:.1f} ms"
        for metric in ("TTFT", "TPOT", "ITL", "E2EL")
    )
    return (
        f"{name:8s} AISBench (Average/P90/P99): {shown}  "
        f"Prefill Token Throughput {figures['Prefill Token Throughput']:.1f} token/s  "
        f"Output Token Throughput {figures['Output Token Throughput']:.1f} token/s  "
        f"Concurrency {figures['Concurrency']:.2f}"
    )
