"""`tokenrelay bench serve --topology engine`: the same requests straight to the engine, in the bench's process.

No HTTP, no bus, no second process: what serving costs over the engine
alone is then one ratio (`serve / engine token throughput`). The engine is
built from the same worker flags (`--worker-args`) a `tokenrelay serve`
gets, and the requests are the same (greedy, seed 1), sent at the same
concurrency and rate; a token's time is when the engine's step hands it out.
"""

from __future__ import annotations

import queue
import random
import time
import uuid

from schemas.messages import SamplingParams, TokenEvent
from tokenrelay.bench.load import Outcome, Request
from tokenrelay.settings import settings_from
from tokenrelay.worker_parts import engine_parts
from workers.engine.engine import Engine
from workers.engine.request import EngineRequest


class EngineTopology:
    def __init__(self, worker_args: list[str]) -> None:
        settings = settings_from(["serve", *worker_args])
        model, config = engine_parts(settings.model, settings.engine)
        self._steps: queue.SimpleQueue[tuple[float, list[TokenEvent]]] = queue.SimpleQueue()
        self._engine = Engine(model, config, lambda events: self._steps.put((time.perf_counter(), events)))
        self._engine.start()

    def close(self) -> None:
        self._engine.stop()

    def send_load(
        self, requests: list[Request], concurrency: int, rate: float, seed: int
    ) -> tuple[list[Outcome], float]:
        """As `bench serve`'s send_load: at most `concurrency` at once, arrivals at `rate` (Poisson) per second."""
        rng = random.Random(seed)
        started = time.perf_counter()
        arrivals, at = [], started
        for _ in requests:
            arrivals.append(at)
            at += rng.expovariate(rate) if rate != float("inf") else 0.0
        outcomes: list[Outcome] = []
        running: dict[str, Outcome] = {}
        while len(outcomes) < len(requests) or running:
            now = time.perf_counter()
            while len(outcomes) < len(requests) and len(running) < concurrency and arrivals[len(outcomes)] <= now:
                outcome = Outcome(sent_at=time.perf_counter(), prompt_tokens=requests[len(outcomes)].prompt_tokens)
                running[self._submit(requests[len(outcomes)])] = outcome
                outcomes.append(outcome)
            try:
                at, events = self._steps.get(timeout=0.005)
            except queue.Empty:
                continue
            for event in events:
                outcome = running[event.request_id]
                if event.error is not None:
                    outcome.error = event.error.message
                outcome.event_times.append(at)
                outcome.token_times.extend([at] * len(event.token_ids))
                if event.finish_reason is not None or event.error is not None:
                    del running[event.request_id]
        return outcomes, time.perf_counter() - started

    def _submit(self, request: Request) -> str:
        now = time.time()
        generation = EngineRequest(
            request_id=uuid.uuid4().hex,
            model="bench",
            prompt_text=request.prompt,
            sampling=SamplingParams(max_new_tokens=request.max_new_tokens, seed=1),
            deadline=now + 3600,
        )
        self._engine.submit(generation, time.monotonic())
        return generation.request_id
