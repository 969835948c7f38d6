"""Which models exist and which workers serve them, from the workers' heartbeats.

A name some worker has announced is known (404 otherwise); a known model with
no live worker is unavailable (503). A worker is live while its heartbeats
keep coming, each within a few of its announced intervals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas.messages import ServedModel, WorkerHeartbeat

MISSED_HEARTBEATS = 3  # how many intervals of silence make a worker dead


@dataclass
class _Worker:
    heartbeat: WorkerHeartbeat
    seen_at: float

    def live(self, now: float) -> bool:
        return now - self.seen_at <= MISSED_HEARTBEATS * self.heartbeat.interval_s


class WorkerDirectory:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._models: dict[str, ServedModel] = {}  # every alias ever announced

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        if heartbeat.leaving:
            self._workers.pop(heartbeat.worker_id, None)
            return
        self._workers[heartbeat.worker_id] = _Worker(heartbeat, time.monotonic())
        for alias in heartbeat.model.aliases:
            self._models[alias] = heartbeat.model

    def lookup(self, name: str) -> ServedModel | None:
        """The model clients call `name`, if any worker ever announced it."""
        return self._models.get(name)

    def served_names(self) -> list[str]:
        """Every name a live worker answers to, aliases included."""
        now = time.monotonic()
        live = {w.heartbeat.model.name for w in self._workers.values() if w.live(now)}
        return sorted(alias for alias, model in self._models.items() if model.name in live)

    def model_names(self) -> list[str]:
        """The canonical names of every model ever announced."""
        return sorted({model.name for model in self._models.values()})

    def live_workers(self, model: str) -> int:
        """Live workers serving the model of canonical name `model`."""
        now = time.monotonic()
        return sum(1 for w in self._workers.values() if w.heartbeat.model.name == model and w.live(now))

    def any_live(self) -> bool:
        now = time.monotonic()
        return any(w.live(now) for w in self._workers.values())
