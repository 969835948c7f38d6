"""Logs, one line per event, for our code and for the libraries beneath it: JSON for machines to read, or
structlog's console lines for a person at a terminal.

Our modules log through structlog (`structlog.get_logger(__name__)`); uvicorn,
aiokafka and transformers log through the standard library, whose records are
rendered the same way. A request id bound with
`structlog.contextvars.bind_contextvars(request_id=...)` appears on every
line logged while the request is handled.

The format is `--log-format` (json or console); by default console where
stderr is a terminal and JSON otherwise (a file, a pipe, a container's log),
as structlog's own development setup chooses.
"""

from __future__ import annotations

import logging
import sys
import time

import structlog

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure(level: str = "info", process: str = "tokenrelay", log_format: str | None = None) -> None:
    """Send every log line of this process to stderr, as `log_format` says (None: console on a terminal, else
    JSON)."""
    terminal = sys.stderr.isatty()
    console = (log_format or ("console" if terminal else "json")) == "console"
    # ConsoleRenderer writes tracebacks itself, as plain text: locals (rich's default) may hold keys and prompts.
    exceptions = [] if console else [structlog.processors.format_exc_info]
    renderer = (
        structlog.dev.ConsoleRenderer(colors=terminal, exception_formatter=structlog.dev.plain_traceback)
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[*_SHARED, *exceptions, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder({"repeated"})],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *exceptions,  # tracebacks of library records, as text
                _add_process(process),
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Libraries that are chatty at INFO: their warnings are what matters.
    for name in ("aiokafka", "kafka", "httpx", "transformers"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    handler.addFilter(RepeatFilter(every_s=5.0, prefix="aiokafka"))
    handler.addFilter(demote_transient)
    for name in ("uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


# aiokafka's lines about what it retries by itself, at the level they deserve: a group coordinator that is not
# elected yet (a broker's first seconds, or just after a coordinator moved) is waited for, not an error.
_TRANSIENT = ("GroupCoordinatorNotAvailableError", "Marking the coordinator dead")


def demote_transient(record: logging.LogRecord) -> bool:
    if record.name.startswith("aiokafka") and record.levelno > logging.INFO:
        if any(sign in record.getMessage() for sign in _TRANSIENT):
            record.levelno, record.levelname = logging.INFO, "INFO"
    return True


class RepeatFilter(logging.Filter):
    """Lets the same message of a library (by logger and format) through once per `every_s` seconds.

    aiokafka retries without a pause while the broker is away and logs every
    try: thousands of identical lines a second. The line that gets through
    says how many were left out (`repeated`).
    """

    def __init__(self, every_s: float, prefix: str) -> None:
        super().__init__()
        self._every_s = every_s
        self._prefix = prefix
        self._last: dict[tuple[str, object], float] = {}
        self._left_out: dict[tuple[str, object], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefix):
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        if now - self._last.get(key, -self._every_s) < self._every_s:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return False
        self._last[key] = now
        left_out = self._left_out.pop(key, 0)
        if left_out:
            record.repeated = left_out
        return True


def _add_process(process: str):
    def add(_, __, event_dict):
        event_dict.setdefault("process", process)
        return event_dict

    return add
