"""`tokenrelay bench scale`, short: a fleet of simulated workers on a real broker, grown from 1 to 2."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.processes import TOKENRELAY

pytestmark = pytest.mark.kafka


def test_the_scale_bench_reports_every_worker_count_and_each_placement_of_a_chat_and_of_adapters(
    kafka_bootstrap, tmp_path
):
    plot = tmp_path / "scale.png"
    quick = ["--duration", "2", "--warmup", "0.5", "--gateways", "1", "--slowdown", "1", "--chat-slowdown", "1"]
    quick += ["--adapter-slowdown", "1"]
    quick += ["--conversations", "4", "--turns", "2", "--chat-workers", "2"]
    quick += ["--adapters", "6", "--adapter-workers", "2", "--max-loras", "2"]
    run = subprocess.run(
        [TOKENRELAY, "bench", "scale", "--workers", "1", "2", *quick, "--kafka-bootstrap", kafka_bootstrap]
        + ["--json", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    one, two = report["scale"]
    assert (one["workers"], two["workers"], one["efficiency"]) == (1, 2, 1.0)
    for row in (one, two):
        assert row["failed"] == 0 and row["token_throughput"] > 0, row
        assert row["streams"] == 6 * row["workers"]  # 1.5 per batch slot of 4
        assert 0 <= row["idle_while_waiting"] <= 1 and len(row["gateway_tokens_per_s"]) == 1
    assert two["efficiency"] == round(two["token_throughput"] / (2 * one["token_throughput"]), 3)
    chat = report["chat"]
    for placement in ("router", "shared_queue", "one_worker"):
        assert chat[placement]["turns"] == 8 and 0 <= chat[placement]["prefix_hit_rate"] <= 1
    assert chat["router"]["prefix_hit_rate"] > 0  # the second turns find their first turns cached
    adapters = report["adapters"]
    for placement in ("router", "shared_queue"):
        result = adapters[placement]
        assert result["failed"] == 0 and result["requests"] > 0, result
        assert result["loads_per_1000_requests"] == round(1000 * result["adapter_loads"] / result["requests"], 1)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_priority_bench_measures_an_urgent_request_idle_and_behind_a_full_batch(kafka_bootstrap):
    args = ["--simulate", "bundled-cpu", "--batch", "4", "--probes", "2", "--settle", "0.5"]
    args += ["--kafka-bootstrap", kafka_bootstrap]
    run = subprocess.run(
        [TOKENRELAY, "bench", "priority", *args, "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["background_streams"] == 8
    assert result["idle_priority1_ttft_ms"] > 0 and result["loaded_priority1_ttft_ms"] > 0
    ratio = result["loaded_priority1_ttft_ms"] / result["idle_priority1_ttft_ms"]
    assert result["loaded_over_idle"] == pytest.approx(ratio, abs=0.02)
    assert result["loaded_priority5_ttft_ms"] > 0
