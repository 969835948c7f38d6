"""Embed requests in the engine: prefills whose pooled hidden states equal transformers' own, pooled alike.

They share steps with generating requests, are chunked like any prompt,
reuse the prefix cache with last-token pooling and never with mean pooling
(whose cached tokens would be missing from the mean). Float32, as served:
within 1e-5 of the bundled model's base model run alone.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace

import pytest
import torch

from schemas.messages import FinishReason
from tests.devices import TEST_DEVICE
from tests.reference import embedding
from tests.test_engine import Harness
from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig
from workers.engine.model_loader import load_model
from workers.engine.pooling import Pooling
from workers.simulated.model import SimulatedModel
from workers.simulated.profile import Profile

TOLERANCE = 1e-5
BLOCK_BYTES = 2 * 4 * 32 * 4 * 32 * 4  # layers, block size, KV heads, head dim, float32
# Steps of 16 tokens (4 sequences at most): the long prompts below take several chunks each.
SMALL_STEPS = {"max_batch_size": 4, "max_tokens_per_step": 16, "kv_cache_bytes": 64 << 20}


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float32")


@pytest.fixture
def engine_of(loaded):
    harnesses: list[Harness] = []

    def make(model=loaded, **config) -> Harness:
        harnesses.append(Harness(model, EngineConfig(**{**SMALL_STEPS, **config})))
        return harnesses[-1]

    yield make
    for h in harnesses:
        h.close()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 32000) for _ in range(length - 1)] for _ in range(count)]


def _check(event, prompt: list[int], pooling: Pooling) -> None:
    assert event.finish_reason == FinishReason.LENGTH and event.token_ids == [] and event.error is None
    assert event.prompt_tokens == len(prompt)
    expected = embedding(prompt, mean=pooling.mean, normalize=pooling.normalize)
    difference = (torch.tensor(event.embedding, dtype=torch.float32) - expected).abs().max().item()
    assert difference <= TOLERANCE, difference


def test_last_token_embeddings_share_steps_with_generation_chunked_and_from_the_prefix_cache(loaded, engine_of):
    h = engine_of()
    generating = h.submit("The following example", 24, ignore_eos=True)
    h.wait_for_tokens(generating, 1)  # decoding: the embeddings join its steps
    long, short = _prompts(1, 70, seed=3)[0], [1, 450, 2446, 1342]
    embeds = {h.submit(p, task="embed"): p for p in (long, short, [1], "A context manager is")}
    results = h.collect([generating, *embeds])
    for request_id, prompt in embeds.items():
        events = results[request_id]
        assert len(events) == 1, events
        ids = prompt if isinstance(prompt, list) else loaded.tokenizer(prompt)["input_ids"]
        _check(events[0], ids, Pooling())
    assert any(results[r][0].batch_size > 1 for r in embeds)  # computed beside the decoding request
    assert len(results[generating]) == 24 and results[generating][-1].finish_reason == FinishReason.LENGTH
    again = h.submit(long, task="embed")  # its first two blocks come from the cache: only the last token must not
    _check(h.collect([again])[again][0], long, Pooling())
    assert h.engine.stats()["reused_tokens"] == 64


def test_mean_pooled_embeddings_sum_every_chunk_and_take_nothing_from_the_prefix_cache(loaded, engine_of):
    mean = Pooling(mean=True, normalize=False)
    h = engine_of(replace(loaded, pooling=mean))
    generating = h.submit("The os module provides", 8, ignore_eos=True)
    prompts = [*_prompts(2, 45, seed=5), [1, 450]]
    embeds = {h.submit(p, task="embed"): p for p in prompts}
    results = h.collect([generating, *embeds])
    for request_id, prompt in embeds.items():
        _check(results[request_id][0], prompt, mean)
    again = h.submit(prompts[0], task="embed")
    _check(h.collect([again])[again][0], prompts[0], mean)
    assert h.engine.stats()["reused_tokens"] == 0


def test_a_mean_pooled_embedding_preempted_mid_prompt_starts_its_sum_again(loaded, engine_of):
    mean = Pooling(mean=True, normalize=False)
    # 33 blocks: the embedding's 32 leave no room for the urgent request, which preempts it.
    h = engine_of(replace(loaded, pooling=mean), max_batch_size=2, max_seq_len=33 * 32, kv_cache_bytes=33 * BLOCK_BYTES)
    prompt = _prompts(1, 1000, seed=13)[0]
    embed = h.submit(prompt, task="embed")
    while h.engine.free_kv_blocks == 33:  # until it is admitted: then it prefills 16 tokens a step, 63 steps
        time.sleep(0.001)
    urgent = h.submit(_prompts(1, 40, seed=14)[0], 4, priority=1)
    results = h.collect([embed, urgent])
    assert h.engine.stats()["preemptions"] == 1
    _check(results[embed][0], prompt, mean)


def test_an_urgent_embedding_is_computed_before_waiting_prompts(loaded, engine_of):
    h = engine_of(max_batch_size=1)  # one sequence at a time: the queue's order is the answers' order
    first = h.submit("The following example", 6, ignore_eos=True)
    h.wait_for_tokens(first, 1)
    waiting = h.submit("A context manager is", 2)
    urgent = h.submit(_prompts(1, 40, seed=9)[0], task="embed", priority=1)
    order = []
    while len(order) < 3:
        event = h.events.get(timeout=60)
        if event.finish_reason is not None:
            order.append(event.request_id)
    assert order.index(urgent) < order.index(waiting)


def test_a_model_without_hidden_states_refuses_embed_requests_naming_it():
    h = Harness(SimulatedModel(Profile.load("bundled-cpu")), EngineConfig(max_batch_size=2, max_tokens_per_step=64))
    try:
        request_id = h.submit("hello", task="embed")
        (event,) = h.collect([request_id])[request_id]
    finally:
        h.close()
    assert event.error.status == 424 and event.error.message == "model m does not compute embeddings"


def _sentence_transformers_dir(tmp_path, modules: list[str], pooling: dict) -> str:
    """A directory with sentence-transformers' module files only (Pooling.of_model reads nothing else)."""
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 256, **pooling}))
    entries = [
        {"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{m}", "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("modules", "mode", "expected"),
    [
        (["Transformer", "Pooling", "Normalize"], "pooling_mode_mean_tokens", Pooling(mean=True, normalize=True)),
        (["Transformer", "Pooling"], "pooling_mode_lasttoken", Pooling(mean=False, normalize=False)),
        (["Transformer", "Pooling"], "pooling_mode_cls_token", None),  # a mode not served
        (["Transformer", "Pooling", "Dense", "Normalize"], "pooling_mode_mean_tokens", None),  # a projection after
    ],
)
def test_pooling_is_what_the_sentence_transformers_modules_say(tmp_path, modules, mode, expected):
    modes = {"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, "pooling_mode_cls_token": False}
    assert Pooling.of_model(_sentence_transformers_dir(tmp_path, modules, {**modes, mode: True})) == expected


def test_without_modules_the_last_token_is_pooled_and_normalised():
    assert Pooling.of_model(str(BUNDLED_MODEL)) == Pooling(mean=False, normalize=True)
