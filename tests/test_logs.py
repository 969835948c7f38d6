"""Library log lines: those that repeat (aiokafka while the broker is away) are thinned out, and say so; those
about what aiokafka retries by itself are info. Metric label values are snake_case."""

from __future__ import annotations

import logging
import time

from telemetry.logs import RepeatFilter, demote_transient
from telemetry.metrics import snake


def _record(name: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), None)


def test_the_same_library_line_passes_once_per_period_with_the_count_left_out():
    thinning = RepeatFilter(every_s=0.2, prefix="aiokafka")
    passed = [thinning.filter(_record("aiokafka.client", "Unable to update metadata from %s")) for _ in range(100)]
    assert passed.count(True) == 1
    assert thinning.filter(_record("aiokafka.client", "another message"))
    assert all(thinning.filter(_record("gateway.service", "ours")) for _ in range(3))  # ours are never thinned
    time.sleep(0.25)
    again = _record("aiokafka.client", "Unable to update metadata from %s")
    assert thinning.filter(again) and again.repeated == 99


def test_aiokafka_retrying_a_coordinator_not_elected_yet_is_info_and_other_errors_stay_errors():
    waiting = _record("aiokafka.consumer.group_coordinator", "Group Coordinator Request failed: %s")
    waiting.args = ("[Error 15] GroupCoordinatorNotAvailableError",)
    assert demote_transient(waiting) and (waiting.levelno, waiting.levelname) == (logging.INFO, "INFO")
    failing = _record("aiokafka.consumer.fetcher", "Failed fetch offsets from 1: NotLeaderForPartitionError")
    assert demote_transient(failing) and failing.levelno == logging.ERROR
    ours = _record("gateway.service", "GroupCoordinatorNotAvailableError")  # only aiokafka's lines are demoted
    assert demote_transient(ours) and ours.levelno == logging.ERROR


def test_label_values_are_snake_case_identifiers():
    reasons = ["Service Unavailable", "stopInfer", "client gone", "Timeout", "handed back by a draining worker"]
    assert [snake(r) for r in reasons] == [
        "service_unavailable",
        "stop_infer",
        "client_gone",
        "timeout",
        "handed_back_by_a_draining_worker",
    ]
