"""Library log lines that repeat (aiokafka while the broker is away) are thinned out, and say so."""

from __future__ import annotations

import logging
import time

from tokenrelay.logs import RepeatFilter


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
