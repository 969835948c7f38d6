"""Running the engine over a bench workload: the requests, what a run measures, and the run itself.

Shared by `tokenrelay bench engine` (engine.py, whose baselines measure the
same way) and its `--speculative` comparison (speculative.py).
"""

from __future__ import annotations

import gc
import queue
import random
import statistics
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

# torch and the engine are imported where they are used, so that `--help` answers at once.
if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.engine.model_loader import LoadedModel


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    adapter: tuple[str, str] | None = None  # a LoRA adapter's (name, directory); None: the base model


@dataclass
class Result:
    requests: int  # asked for
    completed: int  # finished (fewer only when timed out)
    output_tokens: int  # generated, finished or not
    seconds: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_ms: float  # median over completed requests of (last token - first token) / (tokens - 1)
    timed_out: bool = False
    # A speculating engine's (workers/engine/speculation.py): tokens proposed, accepted, and verifications
    speculation: dict[str, int] | None = None


def workload(count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        Request([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(count)
    ]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed_result(
    requests: list[Request],
    started: float,
    first: list[float | None],
    last: list[float | None],
    generated: int | None = None,
    ended: float | None = None,
) -> Result:
    """first/last: each request's first and last token times (None: not reached); a timed-out run gives the
    tokens it generated and when it was stopped."""
    done = [(r, f, lt) for r, f, lt in zip(requests, first, last, strict=True) if lt is not None]
    seconds = (ended if ended is not None else max(lt for _, _, lt in done)) - started
    tokens = generated if generated is not None else sum(r.output_len for r in requests)
    per_token = [(lt - f) / (r.output_len - 1) for r, f, lt in done if r.output_len > 1]
    ttft = [(f - started) * 1000 for f in first if f is not None]
    return Result(
        requests=len(requests),
        completed=len(done),
        output_tokens=tokens,
        seconds=round(seconds, 3),
        tokens_per_s=round(tokens / seconds, 1) if seconds > 0 else 0.0,
        ttft_p50_ms=round(_percentile(ttft, 0.5), 1),
        ttft_p99_ms=round(_percentile(ttft, 0.99), 1),
        tpot_ms=round(statistics.median(per_token) * 1000, 2) if per_token else 0.0,
        timed_out=generated is not None,
    )


def release(device_type: str) -> None:
    """Give back what a finished run held (an engine's KV cache and graphs), before the next one sizes its own."""
    import torch

    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def run_engine(loaded: LoadedModel, config: EngineConfig, requests: list[Request]) -> Result:
    from workers.engine.engine import Engine

    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = Engine(loaded, config, lambda batch: events.put((time.perf_counter(), batch)))
    engine.start()
    try:
        engine_pass(engine, events, requests[:2])  # warm up
        ids = [uuid.uuid4().hex for _ in requests]
        before = engine.stats()
        started = time.perf_counter()
        first, last, _ = engine_pass(engine, events, requests, ids)
        after = engine.stats()
    finally:
        engine.stop()
        del engine
        release(loaded.device_type)
    result = timed_result(requests, started, [first[i] for i in ids], [last[i] for i in ids])
    if not config.speculative:
        return result
    counts = {key: after[f"speculative_{key}"] - before[f"speculative_{key}"] for key in _SPECULATION_COUNTS}
    return replace(result, speculation=counts)


_SPECULATION_COUNTS = ("proposed", "accepted", "verifications")


def generate(loaded: LoadedModel, config: EngineConfig, requests: list[Request]) -> list[list[int]]:
    """Each request's generated tokens."""
    from workers.engine.engine import Engine

    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = Engine(loaded, config, lambda batch: events.put((time.perf_counter(), batch)))
    engine.start()
    try:
        ids = [uuid.uuid4().hex for _ in requests]
        tokens = engine_pass(engine, events, requests, ids)[2]
    finally:
        engine.stop()
    return [tokens[i] for i in ids]


def engine_pass(engine: Engine, events: queue.SimpleQueue, requests: list[Request], ids: list[str] | None = None):
    from schemas.messages import SamplingParams
    from workers.engine.request import EngineRequest

    ids = ids or [uuid.uuid4().hex for _ in requests]
    now = time.time()
    for request_id, request in zip(ids, requests, strict=True):
        sampling = SamplingParams(seed=1, max_new_tokens=request.output_len, ignore_eos=True)
        engine.submit(
            EngineRequest(
                request_id=request_id,
                model="bench",
                prompt_token_ids=request.prompt,
                sampling=sampling,
                deadline=now + 3600,
                adapter=request.adapter[0] if request.adapter else None,
                adapter_path=request.adapter[1] if request.adapter else None,
            ),
            time.monotonic(),
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while len(last) < len(ids):
        at, batch = events.get()
        for event in batch:
            if event.error is not None:
                raise RuntimeError(event.error.message)
            first.setdefault(event.request_id, at)
            tokens[event.request_id] += event.token_ids
            if event.finish_reason is not None:
                last[event.request_id] = at
    return first, last, tokens
