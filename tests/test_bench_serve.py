"""`tokenrelay bench serve`: the same greedy workload through each streaming endpoint, counted alike."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from tests.processes import TOKENRELAY, serving
from tokenrelay.bench.serve import compare, run_load, workload


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("bench-serve")) as served:
        yield served


ARGS = ("--requests", "6", "--concurrency", "3", "--prompt-lens", "8", "24", "--output-lens", "4", "12")


def test_every_streaming_endpoint_delivers_the_same_tokens_and_reports_latencies(server, tmp_path):
    plot = tmp_path / "serve.png"
    command = [TOKENRELAY, "bench", "serve", "--url", server.base_url, "--endpoint", "generate_stream", *ARGS]
    run = subprocess.run(
        [*command, "--json", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    results = {"generate_stream": json.loads(run.stdout.strip().splitlines()[-1])["results"]["server"]}
    requests = workload(6, (8, 24), (4, 12), seed=0)  # what the command sent
    for endpoint in ("infer", "ws"):
        results[endpoint] = asyncio.run(
            run_load(server.base_url, "tokenrelay-tiny", endpoint, requests, concurrency=3, rate=float("inf"), seed=0)
        )
    tokens = {endpoint: result["output_tokens"] for endpoint, result in results.items()}
    assert len(set(tokens.values())) == 1 and 6 <= tokens["ws"] <= 6 * 12, tokens
    for result in results.values():
        assert result["completed"] == result["requests"] == 6 and result["failed"] == 0
        assert result["output_token_throughput"] > 0 and result["request_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            figures = result[metric]
            assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"], (metric, figures)
        assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"]
        # AISBench's names and definitions beside ours (tests/test_bench_aisbench.py checks its arithmetic)
        ais = result["aisbench"]
        assert (ais["Success Requests"], ais["Total Requests"], ais["Max Concurrency"]) == (6, 6, 3)
        assert ais["Total Generated Tokens"] == result["output_tokens"] and ais["Total Input Tokens"] >= 6 * 8
        assert 0 < ais["TTFT"]["Average"] <= ais["E2EL"]["Average"] and ais["TPOT"]["N"] <= 6
        assert 0 < ais["Concurrency"] <= 3 and ais["Prefill Token Throughput"] > 0
    assert "server   AISBench (Average/P90/P99): TTFT " in run.stdout  # the printed table, in AISBench's names
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot: the server's tokens/s, TTFT and ITL


def test_the_comparison_is_kafka_over_serve():
    def result(throughput: float, ttft: float, itl: float) -> dict:
        return {
            "output_token_throughput": throughput,
            "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
            "itl_ms": {"p50": itl, "p99": 3 * itl},
        }

    compared = compare({"serve": result(1000.0, 100.0, 10.0), "kafka": result(950.0, 130.0, 12.0)}, "kafka", "serve")
    assert compared == {
        "kafka_over_serve_token_throughput": 0.95,
        "kafka_added_latency_ms": {"ttft_p50": 30.0, "ttft_p99": 60.0, "itl_p50": 2.0, "itl_p99": 6.0},
    }


def test_the_engine_topology_gets_the_same_tokens_and_serve_is_one_ratio_of_it():
    """`--topology engine serve`: the same greedy requests straight to an engine in the bench's process, then
    through `tokenrelay serve` (its engine in a process of its own): the same tokens, and their throughput ratio."""
    command = [TOKENRELAY, "bench", "serve", "--topology", "engine", "serve", "--rounds", "1", *ARGS, "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    engine, serve = report["results"]["engine"], report["results"]["serve"]
    assert engine["completed"] == serve["completed"] == 6
    assert engine["aisbench"]["Success Requests"] == serve["aisbench"]["Success Requests"] == 6
    assert engine["aisbench"]["Total Generated Tokens"] == serve["aisbench"]["Total Generated Tokens"]
    assert engine["output_tokens"] == serve["output_tokens"] and engine["output_tokens"] >= 6
    ratio = report["comparison"]["serve_over_engine_token_throughput"]
    assert ratio == round(serve["output_token_throughput"] / engine["output_token_throughput"], 3)
    assert "serve / engine token throughput" in run.stdout
