"""A worker's load reports on the routing topic, for the gateways' routers (gateway/dispatch/router.py).

A report goes out when the worker starts, with every heartbeat and, when
the load or the cache changed, as soon as `MIN_GAP_S` has passed since the
previous one: a slot
that frees up is known to the gateways within about a tenth of a second, and
a busy worker sends at most ten reports a second. (A report every 20 ms cost
a CPU worker a tenth of its throughput at low load: its encoding, sending
and reading interrupt the model's steps; a freed slot waits for no report,
as the worker fills it from what waits in its inbox.) Cached prefixes
travel as changes, and whole every `SNAPSHOT_EVERY_S`, so that a gateway
that starts later (it replays the routing topic's last seconds) knows them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from bus.base import Bus
from schemas.messages import WorkerLoad

MIN_GAP_S = 0.1
SNAPSHOT_EVERY_S = 5.0
SNAPSHOT_LIMIT = 20_000  # prefix hashes in one message at most (about 300 kB)


class LoadReporter:
    def __init__(
        self, bus: Bus, topic: str, identity: dict[str, Any], interval_s: float, load: Callable[[], dict[str, Any]]
    ) -> None:
        """`identity`: worker_id, model and inbox; `load()`: the WorkerLoad fields that change."""
        self._bus = bus
        self._topic = topic
        self._identity = identity
        self._interval_s = interval_s
        self._load = load
        self._prefixes: dict[int, None] = {}  # held, oldest first
        self._added: list[int] = []
        self._removed: list[int] = []
        self._changed = asyncio.Event()
        self._snapshot_at = 0.0

    def changed(self) -> None:
        """The load changed: report it soon."""
        self._changed.set()

    def cache_changed(self, added: list[int], removed: list[int]) -> None:
        for prefix in removed:
            self._prefixes.pop(prefix, None)
        self._prefixes.update(dict.fromkeys(added))
        self._added.extend(added)
        self._removed.extend(removed)
        self._changed.set()

    def report(self) -> WorkerLoad:
        now = time.monotonic()
        snapshot = now - self._snapshot_at >= SNAPSHOT_EVERY_S
        if snapshot:
            self._snapshot_at = now
            added, removed = list(self._prefixes)[-SNAPSHOT_LIMIT:], []
        else:
            added, removed = self._added, self._removed
        self._added, self._removed = [], []
        return WorkerLoad(
            **self._identity,
            **self._load(),
            prefixes_added=added,
            prefixes_removed=removed,
            snapshot=snapshot,
            interval_s=self._interval_s,
        )

    async def run(self) -> None:
        """Report at once (a worker that just started is routable as soon as its heartbeat says it serves),
        then with every heartbeat and on changes."""
        while True:
            self._changed.clear()
            await self._bus.publish_or_log(self._topic, self.report(), "load_not_published")
            await asyncio.sleep(MIN_GAP_S)
            try:
                async with asyncio.timeout(self._interval_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
