"""Which models exist and which workers serve them, from the workers' heartbeats and the adapters topic.

A name some worker has announced is known, its model's aliases and the names
of the LoRA adapters it serves (404 otherwise, naming the known ones); a
known model with no live worker is unavailable (503). The adapters loaded
and unloaded at run time (the adapters topic's AdapterState, latest per
name) count at once, whatever the heartbeats say yet: one loaded is known
as soon as its base model is, one unloaded is unknown even while a stale
heartbeat still lists it. The adapters a worker started with (--lora) are
known from its heartbeats, unless the topic says they were unloaded. Until some worker has
announced something, no name is known yet and every one is unavailable
rather than unknown: the workers may still be loading their models. A
worker is live while its heartbeats keep coming, each within a few of its
announced intervals, its silence counted as the failover counts it (up to the
gateway's own last heartbeat heard, while they come back: a broker that
stops right after a worker's late heartbeat is the broker's fault, which the
gateway names once its own heartbeats stay away, not the worker's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import not_found, unavailable
from schemas.messages import AdapterState, ServedModel, WorkerHeartbeat

MISSED_HEARTBEATS = 3  # how many intervals of silence make a worker dead


@dataclass
class _Worker:
    heartbeat: WorkerHeartbeat
    seen_at: float

    def live(self, counted_to: float) -> bool:
        return counted_to - self.seen_at <= MISSED_HEARTBEATS * self.heartbeat.interval_s


class WorkerDirectory:
    def __init__(
        self,
        on_new_model: Callable[[str], None] = lambda name: None,
        counted_to: Callable[[float], float] = lambda now: now,
    ) -> None:
        """`on_new_model(name)`: called with the canonical name of each model when it is first announced;
        `counted_to(now)`: up to when a worker's silence counts (PeerClock.counted_to; default: now)."""
        self._counted_to = counted_to
        self._workers: dict[str, _Worker] = {}
        self._models: dict[str, ServedModel] = {}  # every alias ever announced
        self._adapter_states: dict[str, AdapterState] = {}  # run-time adapters, by name: the latest state
        self._started_at = time.monotonic()
        self._on_new_model = on_new_model

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        if heartbeat.leaving:
            self._workers.pop(heartbeat.worker_id, None)
            return
        self._workers[heartbeat.worker_id] = _Worker(heartbeat, time.monotonic())
        if not any(model.name == heartbeat.model.name for model in self._models.values()):
            self._on_new_model(heartbeat.model.name)
        for alias in heartbeat.model.aliases:
            self._models[alias] = heartbeat.model
        for adapter in heartbeat.model.adapters:  # a LoRA adapter is a model name of its own
            self._models[adapter] = heartbeat.model.under(adapter)

    def adapter_changed(self, state: AdapterState) -> None:
        """A LoRA adapter loaded or unloaded at run time, from the adapters topic (or this gateway's own load); an
        older state than the one known (this gateway's own, come back from the topic) changes nothing."""
        known = self._adapter_states.get(state.name)
        if known is None or state.changed_at >= known.changed_at:
            self._adapter_states[state.name] = state

    def _resolve(self, name: str) -> ServedModel | None:
        state = self._adapter_states.get(name)
        if state is None:
            return self._models.get(name)
        base = self._models.get(state.model)
        if not state.loaded or base is None:
            return None
        return base.model_copy(update={"adapters": {**base.adapters, name: state.path}, "adapter": name})

    def known_names(self) -> list[str]:
        """Every name a client may call, whether a worker serving it lives or not."""
        loaded = [name for name, state in self._adapter_states.items() if state.loaded]
        return sorted(name for name in {*self._models, *loaded} if self._resolve(name) is not None)

    def announced(self, name: str) -> ServedModel:
        """The model clients call `name`; 404 naming the known names if no worker announced it, 503 while none
        has announced anything yet."""
        model = self._resolve(name)
        if model is not None:
            return model
        if not self._models:
            waited_s = time.monotonic() - self._started_at
            raise unavailable(f"no worker has announced model {name} yet ({waited_s:.0f} s since this gateway started)")
        raise not_found(f"model {name} is not served here; served: {', '.join(self.known_names())}")

    def served_names(self) -> list[str]:
        """Every name a live worker answers to, aliases and adapters included."""
        now = self._counted_to(time.monotonic())
        live = {w.heartbeat.model.name for w in self._workers.values() if w.live(now)}
        return [name for name in self.known_names() if self._resolve(name).name in live]

    def model_names(self) -> list[str]:
        """The canonical names of every model ever announced."""
        return sorted({model.name for model in self._models.values()})

    def live_workers(self, model: str) -> int:
        """Live workers serving the model of canonical name `model`."""
        now = self._counted_to(time.monotonic())
        return sum(1 for w in self._workers.values() if w.heartbeat.model.name == model and w.live(now))

    def any_live(self) -> bool:
        now = self._counted_to(time.monotonic())
        return any(w.live(now) for w in self._workers.values())
