"""`tokenrelay bench engine` runs every method on a fixed workload and reports them as one JSON object."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest

from tests.processes import TOKENRELAY
from tests.reference import bundled
from tokenrelay.bench import engine as bench_engine
from tokenrelay.bench import plots
from tokenrelay.bench.chaos import OUTCOMES, Kind, Refused, stream
from tokenrelay.bench.engine import run_static_batches, run_transformers_continuous
from tokenrelay.bench.engine_runs import workload
from workers.engine.config import EngineConfig

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_speculative_bench_compares_each_workload_and_concurrency_with_and_without_proposals():
    """The short path of `tokenrelay bench engine --speculative ngram` (docs/benchmarks.md has a real run), always
    proposing: under the measured rule, whether a run this short verifies anything depends on the machine's load
    (the default workload at concurrency 1 had proposals switched off throughout, in CI once)."""
    argv = ["bench", "engine", "--speculative", "ngram", "--speculative-always", "--concurrency", "1", "2"]
    argv += ["--requests", "4"]
    argv += ["--prompt-lens", "8", "24", "--output-lens", "24", "32", "--copy-prompt-len", "48", "--repeat", "1"]
    run = subprocess.run([TOKENRELAY, *argv, "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    rows = {(row["workload"], row["concurrency"]): row for row in report["rows"]}
    assert set(rows) == {(w, c) for w in ("copy-heavy", "default") for c in (1, 2)}
    for (_, concurrency), row in rows.items():
        assert row["requests"] == (4 if concurrency == 1 else 8)
        off, on = row["off"], row["speculative"]
        assert off["output_tokens"] == on["output_tokens"] and off["speculation"] is None
        counts = on["speculation"]
        assert counts["verifications"] > 0 and 0 <= counts["accepted"] <= counts["proposed"], row
        assert row["tpot_ratio"] == round(off["tpot_ms"] / on["tpot_ms"], 2)
    assert rows[("copy-heavy", 1)]["speculative"]["speculation"]["accepted"] > 0  # the model repeats its own text
    assert report["throughput"]["off"]["requests"] == 4 and report["throughput_ratio"] > 0
    assert report["speculative_always"] is True
    assert "TPOT" in run.stderr and "x lower with ngram" in run.stderr


def test_the_engine_bench_reports_the_engine_every_baseline_the_ratios_and_decode_steps(tmp_path):
    run = subprocess.run(
        [
            TOKENRELAY,
            "bench",
            "engine",
            "--requests",
            "6",
            "--prompt-lens",
            "8",
            "24",
            "--output-lens",
            "4",
            "8",
            "--one-at-a-time",
            "2",
            "--max-batch-size",
            "4",
            "--step-batches",
            "1",
            "3",
            "--json",
            "--plot",
            str(tmp_path / "charts"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    baselines = {"transformers_one_at_a_time", "transformers_static_batches", "transformers_continuous_batching"}
    assert set(report["baselines"]) == set(report["ratios"]) == baselines
    assert report["engine"]["requests"] == 6 and report["baselines"]["transformers_one_at_a_time"]["requests"] == 2
    tokens = report["engine"]["output_tokens"]
    assert 6 * 4 <= tokens <= 6 * 8
    assert report["baselines"]["transformers_static_batches"]["output_tokens"] == tokens
    for result in (report["engine"], *report["baselines"].values()):
        assert result["tokens_per_s"] > 0 and 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
        assert result["timed_out"] is False and result["completed"] == result["requests"]
    for name, ratio in report["ratios"].items():
        expected = report["engine"]["tokens_per_s"] / report["baselines"][name]["tokens_per_s"]
        assert abs(ratio - expected) < 0.01
    # Each method's line is printed as it finishes, the runs before the best.
    lines = [line[:42].strip() for line in run.stderr.splitlines() if "tok/s  TTFT" in line]
    methods = ["engine (native, run {})", "engine (transformers, run {})", "transformers_static_batches (run {})"]
    assert lines[:6] == [method.format(run) for run in (1, 2) for method in methods]
    # Both model implementations, side by side: the same tokens, and the ratio of their tokens/s.
    engines = report["engines"]
    assert set(engines) == {"native", "transformers"} and engines["native"] == report["engine"]
    assert engines["transformers"]["output_tokens"] == tokens
    assert report["impl_ratio"] == round(engines["native"]["tokens_per_s"] / engines["transformers"]["tokens_per_s"], 2)
    assert [s["batch"] for s in report["decode_steps_by_impl"]["transformers"]] == [1, 3]
    assert report["decode_steps_by_impl"]["native"] == report["decode_steps"]
    steps = report["decode_steps"]
    assert [s["batch"] for s in steps] == [1, 3] and steps[1]["mean_context"] > 0
    for step in steps:  # no CUDA graphs on the CPU
        assert step["eager_ms"] > 0 and step["bound_ms"] > 0 and step["graphed_ms"] is None
        # Each figure is rounded apart (ms to 3 places, the ratio to 2): the ratio of the rounded ms is off by up
        # to 0.0005 / bound x (1 + ratio) + 0.005, 0.015 for a 51x step on a machine under load.
        assert step["eager_over_bound"] == pytest.approx(step["eager_ms"] / step["bound_ms"], rel=1e-3, abs=0.01)
    # --plot DIR: the chart of every method, named after the bench.
    assert (tmp_path / "charts" / "engine.png").read_bytes()[:8] == PNG


def test_the_chaos_chart_draws_a_run_with_kills_and_every_outcome(tmp_path):
    result = {"requests": 7, "workers_killed": 2, **dict.fromkeys(OUTCOMES, 0), "completed": 6, "lost": 1}
    ended = [(0.4, "completed"), (1.2, "completed"), (2.5, "lost"), (2.6, "completed"), (3.9, "completed")]
    ended += [(4.1, "completed"), (4.2, "completed")]
    path = plots.chaos(result, ended, [1.0, 3.0], [0.8, 1.7], 4.0, plots.target(str(tmp_path / "c.png"), "chaos"))
    assert path == tmp_path / "c.png" and path.read_bytes()[:8] == PNG


def test_a_baseline_past_its_timeout_reports_what_it_made_by_then(monkeypatch):
    waits: list[float] = []  # every wait of transformers' continuous batching for a finished request, warm-up's too
    finished = bench_engine._finished
    monkeypatch.setattr(
        bench_engine, "_finished", lambda manager, timeout_s: waits.append(timeout_s) or finished(manager, timeout_s)
    )
    loaded = bundled()
    requests = workload(4, (8, 16), (5, 9), loaded.vocab_size, seed=3)
    static = run_static_batches(loaded, requests, 2, timeout_s=0.0)
    # The first step of the first batch is already late: its two rows have one token each.
    assert static.timed_out and static.completed == 0 and static.output_tokens == 2 and static.requests == 4
    small = EngineConfig(kv_cache_bytes=64 << 20).for_device("cpu")
    continuous = run_transformers_continuous(loaded, requests, timeout_s=0.0, engine=small)
    assert continuous.timed_out and continuous.completed < 4  # transformers takes tens of ms for any of them
    assert waits and max(waits) <= 0.0  # its warm-up waited 600 s, whatever the limit


def test_transformers_continuous_batching_runs_within_the_engine_s_budgets_whatever_memory_is_free(monkeypatch):
    """The baseline gets the engine's KV cache and step budgets, so it needs the same memory on any machine:
    it runs where transformers finds only 3 GiB available. Sized by transformers itself (8192 tokens a step
    over the engine's 1 GiB of KV cache) it would reserve ~11 GB and refuse to start (MemoryError)."""
    from transformers.generation.continuous_batching import cache

    monkeypatch.setattr(cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 3 * 2**30)
    loaded = bundled()
    requests = workload(3, (8, 16), (4, 6), loaded.vocab_size, seed=5)
    result = run_transformers_continuous(loaded, requests, 300, EngineConfig().for_device("cpu"))
    assert result.completed == 3 and result.output_tokens == sum(r.output_len for r in requests)


async def test_a_connection_closed_before_any_answer_is_a_refusal_to_retry_elsewhere():
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the request has begun to arrive; the gateway stops before answering it
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient() as client:
        with pytest.raises(Refused, match="RemoteProtocolError|ReadError"):
            await stream(client, f"http://127.0.0.1:{port}/v2/models/m/generate_stream", Kind("x", 1, 4))


def test_the_engine_bench_runs_the_engine_split_beside_the_whole_model_and_says_the_collectives_share():
    run = subprocess.run(
        [TOKENRELAY, "bench", "engine", "--model-impl", "native", "--tensor-parallel-size", "2", "--repeat", "1"]
        + ["--requests", "4", "--prompt-lens", "8", "24", "--output-lens", "4", "8", "--step-batches", "1"]
        + ["--skip", "one_at_a_time", "static_batches", "continuous", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    engines, split = report["engines"], report["tensor_parallel"]
    assert set(engines) == {"native", "native_tp2"}
    assert engines["native_tp2"]["output_tokens"] == engines["native"]["output_tokens"] > 0
    assert split["size"] == 2
    assert split["ratio"] == round(engines["native_tp2"]["tokens_per_s"] / engines["native"]["tokens_per_s"], 2)
    assert 0 < split["collective_share"] < 1
    assert [s["batch"] for s in report["decode_steps_by_impl"]["native_tp2"]] == [1]


def test_the_host_bench_reports_each_part_from_the_steps_it_ran():
    """The short path of `tokenrelay bench host` (docs/bench.md): a batch of 4, so its steps are few."""
    argv = ["bench", "host", "--max-batch-size", "4", "--prompt-lens", "8", "16", "--output-lens", "4", "8"]
    run = subprocess.run([TOKENRELAY, *argv, "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["max_batch_size"] == 4 and report["requests"] == 16  # 4 per slot of the batch
    zero, device, runner = report["zero_cost"], report["device"], report["runner"]
    assert zero["utilization"] == 0.0 and zero["profile"] == "zero-cost"  # its steps cost nothing: all host
    assert device["profile"] == "llama-1.1b-h200" and 0 < device["utilization"] < 1
    for part in (zero, device, runner):
        # at least one step per output token of the longest request, and never more than the batch in one
        assert part["steps"] >= 8 and 1 <= part["mean_batch"] <= 4, part
        assert part["host_ms_per_step"] > 0 and part["tokens_per_s"] > 0, part
    assert len(zero["runs_host_ms_per_step"]) == len(runner["runs_runner_ms_per_step"]) == 1  # --repeat 1
    assert runner["runner_ms_per_step"] > 0 and 0 < runner["utilization"] < 1  # the runner's share of the wall
    assert "device utilization" in run.stderr and "runner (negligible model)" in run.stderr
