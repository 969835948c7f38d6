"""Simulated workers: the real engine around a step-time profile, without torch."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from schemas.messages import SamplingParams
from tests.test_scheduler import _sequence
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import EngineRequest
from workers.engine.scheduler import Chunk
from workers.simulated.model import SimulatedModel, simulated_token
from workers.simulated.profile import Profile, StepCost, names

PROFILE = Profile("test", "estimate: for tests", 8, 256, 4096, StepCost(0.001, 1e-5, 1e-4, 1e-7))


def test_a_simulated_worker_loads_neither_torch_nor_transformers():
    code = (
        "import sys, tokenrelay.cli, workers.worker, workers.simulated.model;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_shipped_profiles_load_and_say_where_their_figures_come_from():
    assert {"bundled-cpu", "llama-1.1b-h200"} <= set(names())
    assert Profile.load("bundled-cpu").source.startswith("measured")
    assert Profile.load("llama-1.1b-h200").source.startswith("estimate")


def test_a_step_takes_the_profiles_time_for_its_shape():
    model = SimulatedModel(PROFILE)
    runner = model.runner(model.engine_config(EngineConfig()))
    prompt, decoding = _sequence(list(range(100)), name="p"), _sequence(list(range(40)), name="d")
    decoding.num_cached_tokens = 39
    started = time.monotonic()
    output = runner.execute([Chunk(prompt, 100), Chunk(decoding, 1)], [Chunk(decoding, 1)])
    expected = PROFILE.step.seconds(100, 1, 100 + 40)
    assert runner.busy_s == expected and time.monotonic() - started >= expected
    assert output.tokens == [simulated_token(1, 0)] and output.logprobs == [None]


def _run(engine: Engine, events: queue.Queue, request: EngineRequest) -> list:
    engine.submit(request, time.monotonic())
    got = []
    while not got or got[-1].finish_reason is None:
        got.append(events.get(timeout=10))
    return got


@pytest.fixture
def simulated() -> Iterator[tuple[SimulatedModel, Engine, queue.Queue]]:
    """A started engine around the test profile's model, and the queue its events land in."""
    model = SimulatedModel(PROFILE)
    events: queue.Queue = queue.Queue()
    engine = Engine(model, model.engine_config(EngineConfig()), lambda batch: [events.put(e) for e in batch])
    engine.start()
    yield model, engine, events
    engine.stop()


def test_tokens_come_from_the_seed_and_index_so_a_failover_goes_on_exactly(simulated):
    _, engine, events = simulated
    now = time.time()
    fields = dict(model="m", prompt_text="a prompt " * 40, deadline=now + 60)
    whole = _run(
        engine,
        events,
        EngineRequest(request_id="a", sampling=SamplingParams(seed=7, max_new_tokens=6), **fields),
    )
    tokens = [e.token_ids[0] for e in whole]
    assert tokens == [simulated_token(7, i) for i in range(6)]
    resumed = EngineRequest(
        request_id="b",
        attempt=1,
        generated_token_ids=tokens[:2],
        sampling=SamplingParams(seed=7, max_new_tokens=6),
        **fields,
    )
    rest = _run(engine, events, resumed)
    assert [e.token_ids[0] for e in rest] == tokens[2:]
    assert "".join(e.text for e in rest) == "".join(e.text for e in whole[2:])
    assert engine.prompt_stats()["cached_prompt_tokens"] > 0  # the second found the first's prompt cached


def test_a_simulated_worker_tokenizes_and_detokenizes_with_its_own_tokenizer(simulated):
    model, engine, events = simulated
    fields = dict(model="m", sampling=SamplingParams(seed=1), deadline=time.time() + 60)
    text = "héllo wörld 日本"
    [tokenized] = _run(engine, events, EngineRequest(request_id="t", task="tokenize", prompt_text=text, **fields))
    ids = model.tokenizer(text)["input_ids"]
    assert [t.id for t in tokenized.tokens] == ids and tokenized.prompt_tokens == len(ids)
    # Each 4-byte piece's place: the characters its bytes touch.
    assert [text[t.start : t.stop] for t in tokenized.tokens] == ["hél", "lo w", "örl", "d 日", "日本"]
    [decoded] = _run(engine, events, EngineRequest(request_id="d", task="detokenize", prompt_token_ids=ids, **fields))
    assert decoded.text == model.tokenizer.decode(ids) and decoded.finish_reason is not None
