"""The engine on the bundled model: exact tokens, events, limits, cancellation."""

from __future__ import annotations

import queue
import time
import uuid

import pytest
import torch

from schemas.messages import FinishReason, GenerationRequest, SamplingParams, TokenEvent
from workers.engine.engine import Engine, EngineLimits
from workers.engine.model_runner import BUNDLED_MODEL, load_model

# With the bundled model, greedy decoding ends these two with EOS within a few
# tokens, and runs on past 400 tokens for the other two.
PROMPTS = [
    "The os module provides",
    "The following example",
    "A context manager is",
    "def main():\n",
]
LONG = PROMPTS[1]


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(BUNDLED_MODEL), "cpu")


class Harness:
    """An engine whose events land in a queue the test reads."""

    def __init__(self, loaded, limits: EngineLimits) -> None:
        self.events: queue.Queue[TokenEvent] = queue.Queue()
        self.engine = Engine(loaded, limits, lambda events: [self.events.put(e) for e in events])
        self.engine.start()

    def submit(self, prompt: str | list[int], max_new_tokens: int = 16, timeout_s: float = 60, **sampling) -> str:
        request_id = uuid.uuid4().hex
        now = time.time()
        self.engine.submit(
            GenerationRequest(
                request_id=request_id,
                model="m",
                prompt_text=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                sampling=SamplingParams(seed=sampling.pop("seed", 1), max_new_tokens=max_new_tokens, **sampling),
                arrival=now,
                deadline=now + timeout_s,
                reply_to="replies",
            ),
            time.monotonic(),
        )
        return request_id

    def collect(self, request_ids: list[str], timeout_s: float = 120) -> dict[str, list[TokenEvent]]:
        """Every event of these requests, until each has ended."""
        by_request: dict[str, list[TokenEvent]] = {r: [] for r in request_ids}
        open_requests = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while open_requests:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if event.request_id in by_request:
                by_request[event.request_id].append(event)
                if event.finish_reason is not None:
                    open_requests.discard(event.request_id)
        return by_request

    def close(self) -> None:
        self.engine.stop()


@pytest.fixture
def harness_with(loaded):
    """Harnesses with engine limits of the test's choosing, closed at the end."""
    harnesses: list[Harness] = []

    def make(limits: EngineLimits | None = None) -> Harness:
        harnesses.append(Harness(loaded, limits or EngineLimits()))
        return harnesses[-1]

    yield make
    for h in harnesses:
        h.close()


@pytest.fixture
def harness(harness_with):
    return harness_with()


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _reference(loaded, prompt: str, max_new_tokens: int) -> list[int]:
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    eos = next((i for i, t in enumerate(out) if t in loaded.eos_token_ids), None)
    return out if eos is None else out[: eos + 1]


def test_greedy_tokens_equal_transformers_generate_with_staggered_arrivals(loaded, harness):
    lengths = [12, 5, 20, 9]
    early = [harness.submit(p, n) for p, n in zip(PROMPTS[:2], lengths[:2], strict=True)]
    while harness.events.empty():  # the first two are running before the others arrive
        time.sleep(0.005)
    late = [harness.submit(p, n) for p, n in zip(PROMPTS[2:], lengths[2:], strict=True)]
    results = harness.collect(early + late)
    for request_id, prompt, n in zip(early + late, PROMPTS, lengths, strict=True):
        assert _tokens(results[request_id]) == _reference(loaded, prompt, n), prompt


def test_events_describe_every_token(loaded, harness):
    request_id = harness.submit(LONG, 8)
    events = harness.collect([request_id])[request_id]
    assert [e.index for e in events] == list(range(8))
    assert all(len(e.token_ids) == 1 for e in events)
    first, rest = events[0], events[1:]
    assert first.prompt_tokens == len(loaded.tokenizer(LONG)["input_ids"])
    assert first.prefill_time_ms > 0 and first.decode_time_ms is None
    assert all(e.prefill_time_ms is None and e.decode_time_ms > 0 for e in rest)
    assert all(e.batch_size == 1 for e in events)
    assert [e.finish_reason for e in events] == [None] * 7 + [FinishReason.LENGTH]
    text = "".join(e.text for e in events)
    assert text == loaded.tokenizer.decode(_tokens(events), skip_special_tokens=True)


def test_eos_ends_a_request_and_counts_as_generated(loaded, harness):
    request_id = harness.submit(PROMPTS[0], 50)
    events = harness.collect([request_id])[request_id]
    assert events[-1].finish_reason == FinishReason.EOS_TOKEN
    assert events[-1].token_ids[0] in loaded.eos_token_ids and events[-1].text == ""
    assert len(events) < 50


def test_batch_size_counts_the_sequences_of_the_step(harness):
    ids = [harness.submit(LONG, 30) for _ in range(4)]
    results = harness.collect(ids)
    assert max(e.batch_size for events in results.values() for e in events) == 4


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(harness):
    sampling = dict(do_sample=True, temperature=1.3, top_k=50, seed=4242)
    alone = harness.submit(PROMPTS[1], 20, **sampling)
    alone_tokens = _tokens(harness.collect([alone])[alone])
    crowd = [harness.submit(p, 25, seed=i + 1, do_sample=True) for i, p in enumerate(PROMPTS)]
    again = harness.submit(PROMPTS[1], 20, **sampling)
    results = harness.collect(crowd + [again])
    assert _tokens(results[again]) == alone_tokens


def test_cancel_ends_the_request_within_a_step(harness):
    request_id = harness.submit(LONG, 500)
    while harness.events.empty():
        time.sleep(0.005)
    harness.engine.cancel(request_id)
    events = harness.collect([request_id])[request_id]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE
    assert events[-1].token_ids == []
    assert len(events) < 50


def test_max_iter_times_caps_max_new_tokens(harness_with):
    h = harness_with(EngineLimits(max_iter_times=3))
    request_id = h.submit(LONG, 100)
    events = h.collect([request_id])[request_id]
    assert len(_tokens(events)) == 3 and events[-1].finish_reason == FinishReason.LENGTH


def test_max_seq_len_ends_generation(harness_with):
    h = harness_with(EngineLimits(max_seq_len=12))
    request_id = h.submit(list(range(100, 110)), 100)  # 10 prompt tokens: 2 more reach 12
    events = h.collect([request_id])[request_id]
    assert len(_tokens(events)) == 2 and events[-1].finish_reason == FinishReason.LENGTH


def test_prompt_longer_than_allowed_is_refused_with_424(harness_with):
    h = harness_with(EngineLimits(max_input_len=8))
    request_id = h.submit(list(range(100, 109)), 4)
    [event] = h.collect([request_id])[request_id]
    assert event.error.status == 424 and event.error.error_type == "Generation Error"
    assert "9 tokens" in event.error.message and "at most 8" in event.error.message


def test_token_id_outside_the_vocabulary_is_refused_with_424(harness):
    request_id = harness.submit([5, 32000], 4)
    [event] = harness.collect([request_id])[request_id]
    assert event.error.status == 424
    assert "32000" in event.error.message and "[0, 32000)" in event.error.message


def test_a_request_past_its_deadline_ends_with_a_timeout(harness):
    request_id = harness.submit(LONG, 500, timeout_s=0.3)
    events = harness.collect([request_id])[request_id]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE
    assert events[-1].error.status == 504 and events[-1].error.error_type == "Timeout"
