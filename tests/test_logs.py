"""Log lines: JSON, or console lines on a terminal (--log-format). Library lines that repeat (aiokafka while the
broker is away) are thinned out, and say so; those about what aiokafka retries by itself are info. Metric label
values are snake_case."""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
import sys
import time

from telemetry.logs import RepeatFilter, demote_transient
from telemetry.metrics import snake
from tests.processes import TOKENRELAY


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


# A process that writes one line and exits: the device refusal, said before anything loads.
REFUSED = [TOKENRELAY, "serve", "--device", "npu"]
CONSOLE = re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+Z \[error\s*\] cannot_start\s+error='--device npu: .*' process=serve")


def _on_a_terminal(command: list[str]) -> str:
    """What `command` writes to stderr when stderr is a terminal (a pseudo-terminal's), as it came."""
    leader, follower = pty.openpty()
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower) as process:
        os.close(follower)
        written = b""
        while chunk := _read(leader):
            written += chunk
        assert process.wait(30) == 1
    os.close(leader)
    return written.decode()


def _read(terminal: int) -> bytes:
    try:
        return os.read(terminal, 4096)
    except OSError:  # EIO: the process closed the terminal's other end
        return b""


def test_log_lines_are_console_lines_on_a_terminal_and_json_elsewhere_unless_log_format_says():
    on_terminal = _on_a_terminal(REFUSED)
    assert "\x1b[" in on_terminal  # coloured, as structlog's ConsoleRenderer colours a terminal's lines
    [line] = re.sub(r"\x1b\[[0-9;]*m", "", on_terminal).splitlines()
    assert CONSOLE.fullmatch(line), line
    [line] = _on_a_terminal([*REFUSED, "--log-format", "json"]).splitlines()
    assert json.loads(line)["event"] == "cannot_start"

    piped = subprocess.run(REFUSED, capture_output=True, text=True, timeout=30)  # a pipe: what tests and logs read
    [line] = piped.stderr.splitlines()
    assert json.loads(line)["event"] == "cannot_start"
    for asked in ([*REFUSED, "--log-format", "console"], REFUSED):
        environment = {**os.environ, "TOKENRELAY_LOG_FORMAT": "console"} if asked == REFUSED else None
        piped = subprocess.run(asked, capture_output=True, text=True, timeout=30, env=environment)
        [line] = piped.stderr.splitlines()
        assert CONSOLE.fullmatch(line), line  # no colour where no terminal shows it


# A library's record with a traceback, logged in a process of its own (configure() sets this process's logging).
LIBRARY_ERROR = """
import logging, sys
from telemetry import logs
logs.configure("info", process="test", log_format=sys.argv[1])
try:
    raise ValueError("broken")
except ValueError:
    logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
"""


def test_a_library_record_with_a_traceback_is_one_event_in_either_format():
    for log_format in ("json", "console"):
        run = subprocess.run([sys.executable, "-c", LIBRARY_ERROR, log_format], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert "Traceback (most recent call last)" in run.stderr and "ValueError: broken" in run.stderr
        if log_format == "json":
            [line] = run.stderr.splitlines()
            assert json.loads(line)["event"] == "Exception in ASGI application"
        else:
            assert "[error    ] Exception in ASGI application" in run.stderr.splitlines()[0]
