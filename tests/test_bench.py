"""`tokenrelay bench engine` runs every method on a fixed workload and reports them as one JSON object."""

from __future__ import annotations

import json
import subprocess

from tests.processes import TOKENRELAY


def test_the_engine_bench_reports_the_engine_every_baseline_and_the_ratios():
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
            "--json",
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
    for name, ratio in report["ratios"].items():
        expected = report["engine"]["tokens_per_s"] / report["baselines"][name]["tokens_per_s"]
        assert abs(ratio - expected) < 0.01
