"""A rolling restart under load on the real broker: every gateway and worker replaced, one at a time, by SIGTERM.

The same run as `tokenrelay bench rolling` (tokenrelay/bench/rolling.py), with the replacements started at
once with the fleet (`--spares`).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.processes import SIMULATED, usage_of
from tokenrelay.bench.chaos import FAILURES
from tokenrelay.bench.rolling import run_rolling, start_fleet

pytestmark = pytest.mark.kafka

DRAIN_TIMEOUT_S = 30.0  # its workers are SIMULATED: six of them start in seconds, not a minute of loading torch


def test_a_rolling_restart_under_load_loses_nothing(kafka_bootstrap, topic_prefix, tmp_path):
    """2 gateways and 3 workers; each worker in turn gets SIGTERM while a replacement starts, then each gateway.
    The first worker gets a second SIGTERM half a second later: its streams are handed over mid-way."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    fleet = start_fleet(
        kafka,
        tmp_path,
        gateways=2,
        workers=3,
        drain_timeout_s=DRAIN_TIMEOUT_S,
        spares=True,
        worker_args=list(SIMULATED),
    )
    try:
        result = asyncio.run(run_rolling(fleet, concurrency=6, hang_after_s=60))
    finally:
        fleet.stop()
    print(result)  # the counts, for the CI log
    assert {o: result[o] for o in FAILURES} == dict.fromkeys(FAILURES, 0), result
    assert result["completed"] > 30, result
    assert [p["exit_code"] for p in result["stopped"]] == [0] * 5, result["stopped"]
    assert all(p["seconds"] < DRAIN_TIMEOUT_S for p in result["stopped"]), result["stopped"]
    workers = [p for p in result["stopped"] if "handed_over" in p]
    assert workers[0]["handed_over"] > 0 and [w["handed_over"] for w in workers[1:]] == [0, 0], workers
    assert result["retried_elsewhere"] > 0, result  # clients met a draining or gone gateway, and went on
    # Usage, metered once per request through every gateway's restart: one record for each stream the clients
    # saw end (none twice), and as many output tokens as they received.
    usage = usage_of(kafka_bootstrap, topic_prefix)
    (row,) = usage["rows"]
    assert usage["records"] == usage["requests"] == row["finished"] == result["streams_ended"], (usage, result)
    assert row["output_tokens"] == result["output_tokens"], (usage, result)
