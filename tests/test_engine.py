"""The engine on the bundled model: exact tokens under continuous batching, events, limits, cancellation.

The equality tests run in float64, so that no rounding difference between a
batched step and transformers' own one-request `generate` can flip a token.
They run on the CPU, or on a GPU with TOKENRELAY_TEST_DEVICE=cuda (Triton
kernels and CUDA graphs there); the Triton kernels and decode graphs also
run on the CPU, interpreted and replayed eagerly, in a test of their own.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import queue
import random
import re
import time
import uuid
from dataclasses import replace

import pytest
import structlog
import torch
from llguidance import LLMatcher

from schemas.messages import ChatMessage, FinishReason, SamplingParams, Task, TokenEvent, Tokenization
from tests.devices import TEST_DEVICE
from tests.test_cuda_graphs import replay_eagerly
from workers.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from workers.engine import model_runner
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.model_loader import load_model, random_model
from workers.engine.model_runner import KVGeometry, ModelRunner, StepLayout, current_cuda_device
from workers.engine.output_head import OutputHead
from workers.engine.request import EngineRequest
from workers.engine.sampler import Draw, DrawBatch, choose

# With the bundled model, greedy decoding ends these two with EOS within a few
# tokens, and runs on past 400 tokens for the other two.
PROMPTS = [
    "The os module provides",
    "The following example",
    "A context manager is",
    "def main():\n",
]
LONG = PROMPTS[1]
BLOCK_BYTES_F64 = 2 * 4 * 32 * 4 * 32 * 8  # layers, block size, KV heads, head dim, float64


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64")


@pytest.fixture(scope="module")
def reference():
    """transformers' own model, for its generate (the engine runs the native one)."""
    return load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64", model_impl="transformers")


class Harness:
    """An engine whose events land in a queue the test reads."""

    def __init__(self, loaded, config: EngineConfig, graph_capture=None) -> None:
        self.events: queue.Queue[TokenEvent] = queue.Queue()
        self.seen: list[TokenEvent] = []  # read by wait_for_tokens, not yet by collect
        self.engine = Engine(loaded, config, lambda events: [self.events.put(e) for e in events], graph_capture)
        self.engine.start()

    def _next(self, deadline: float) -> TokenEvent:
        if self.seen:
            return self.seen.pop(0)
        return self.events.get(timeout=max(0.0, deadline - time.monotonic()))

    def submit(
        self,
        prompt,
        max_new_tokens: int = 16,
        timeout_s: float = 120,
        priority: int = 5,
        generated=(),
        task: Task = "generate",
        adapter: str | None = None,
        adapter_path: str | None = None,
        **sampling,
    ) -> str:
        request_id = uuid.uuid4().hex
        now = time.time()
        self.engine.submit(
            EngineRequest(
                request_id=request_id,
                model="m",
                task=task,
                prompt_text=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                sampling=SamplingParams(seed=sampling.pop("seed", 1), max_new_tokens=max_new_tokens, **sampling),
                priority=priority,
                generated_token_ids=list(generated),
                deadline=now + timeout_s,
                adapter=adapter,
                adapter_path=adapter_path,
            ),
            time.monotonic(),
        )
        return request_id

    def collect(self, request_ids: list[str], timeout_s: float = 300) -> dict[str, list[TokenEvent]]:
        """Every event of these requests, until each has ended."""
        by_request: dict[str, list[TokenEvent]] = {r: [] for r in request_ids}
        open_requests = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while open_requests:
            event = self._next(deadline)
            if event.request_id in by_request:
                by_request[event.request_id].append(event)
                if event.finish_reason is not None:
                    open_requests.discard(event.request_id)
        return by_request

    def wait_for_tokens(self, request_id: str, count: int) -> None:
        """Until `count` events of the request have come; every event stays there for collect."""
        found = 0
        while found < count:
            event = self.events.get(timeout=60)
            self.seen.append(event)
            found += event.request_id == request_id

    def close(self) -> None:
        self.engine.stop()


@pytest.fixture
def harness_with(loaded):
    """Harnesses with engine settings of the test's choosing, closed at the end."""
    harnesses: list[Harness] = []

    def make(graph_capture=None, **config) -> Harness:
        harnesses.append(Harness(loaded, EngineConfig(**{"kv_cache_bytes": 256 << 20, **config}), graph_capture))
        return harnesses[-1]

    yield make
    for h in harnesses:
        h.close()


@pytest.fixture
def harness(harness_with):
    return harness_with()


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _reference(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=reference.device)
    with torch.inference_mode():
        out = reference.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    eos = next((i for i, t in enumerate(out) if t in reference.eos_token_ids), None)
    return out if eos is None else out[: eos + 1]


@pytest.mark.parametrize("speculative", ["", "ngram", "draft"])
def test_64_greedy_requests_equal_transformers_generate_token_for_token(loaded, reference, harness_with, speculative):
    """With proposals too, prompt lookup's or the bundled draft model's (workers/engine/speculation.py): the same
    tokens."""
    rng = random.Random(7)
    shared = [rng.randrange(4, 32000) for _ in range(70)]  # a prefix some prompts share
    workload = []
    for i in range(64):
        body = [rng.randrange(4, 32000) for _ in range(rng.randint(2, 120))]
        workload.append((shared + body if i % 4 == 0 else body, rng.randint(3, 40), rng.choice([1, 3, 5])))
    # A cache too small for everyone at once and small prompt chunks: requests are chunked,
    # preempted and recomputed, and prefixes are reused along the way.
    h = harness_with(
        max_batch_size=24,
        max_tokens_per_step=64,
        max_seq_len=512,
        kv_cache_bytes=40 * BLOCK_BYTES_F64,
        speculative=speculative,
        speculative_always=True,  # every step proposes: the measured rule's choice depends on the machine's timings
        speculative_model=str(BUNDLED_DRAFT_MODEL) if speculative == "draft" else None,
    )
    ids = []
    for wave in range(4):  # staggered arrivals: each wave joins a running batch
        ids += [h.submit(p, n, priority=prio) for p, n, prio in workload[wave * 16 : (wave + 1) * 16]]
        h.wait_for_tokens(ids[-1], 1) if wave < 3 else None
    results = h.collect(ids)
    for request_id, (prompt, max_new, _) in zip(ids, workload, strict=True):
        assert _tokens(results[request_id]) == _reference(reference, prompt, max_new), request_id
    stats = h.engine.stats()
    assert stats["preemptions"] > 0 and stats["reused_tokens"] > 0, stats
    assert (stats["speculative_accepted"] > 10) == bool(speculative), stats


@pytest.mark.parametrize("speculative", ["", "ngram"])
def test_the_triton_kernels_and_decode_graphs_equal_transformers_generate(loaded, reference, harness_with, speculative):
    """On the CPU: the kernels interpreted, the graphs' capture replaced by eager replays of their buffers; with
    proposals (speculation.py), their verification steps replay the decode graphs too."""
    rng = random.Random(11)
    shared = [rng.randrange(4, 32000) for _ in range(34)]
    workload = [(shared + [rng.randrange(4, 32000) for _ in range(n)], m) for n, m in [(3, 9), (30, 6), (1, 12)]]
    workload += [([rng.randrange(4, 32000) for _ in range(n)], m) for n, m in [(1, 7), (20, 10), (60, 5)]]
    workload.append((loaded.tokenizer(LONG)["input_ids"], 40))  # text that repeats itself: proposals accepted
    capture = replay_eagerly if TEST_DEVICE.type == "cpu" else None
    # Prompt chunks of at most 48 tokens: long prompts are chunked beside decoding sequences.
    h = harness_with(
        attention="triton",
        graph_capture=capture,
        max_batch_size=4,
        max_tokens_per_step=48,
        speculative=speculative,
        speculative_always=True,  # every step proposes: the measured rule's choice depends on the machine's timings
    )
    ids = [h.submit(*workload[0])]
    h.wait_for_tokens(ids[0], 2)  # the rest joins a running batch, the shared prefix cached; 4 run at once
    ids += [h.submit(p, n) for p, n in workload[1:]]
    results = h.collect(ids)
    for request_id, (prompt, max_new) in zip(ids, workload, strict=True):
        assert _tokens(results[request_id]) == _reference(reference, prompt, max_new), request_id
    stats = h.engine.stats()
    assert stats["reused_tokens"] >= 32, stats  # the shared prefix's full block
    assert (stats["speculative_accepted"] > 0) == bool(speculative), stats


def _mixed_step() -> StepLayout:
    """Three sequences decoding (contexts 40, 70, 5), then a 10-token prompt chunk after 32 cached tokens."""
    return StepLayout([5, 6, 7, *range(10, 20)], [39, 69, 4, *range(32, 42)],
                      [39, 32 * 4 + 5, 32 * 5 + 4, *(32 * 7 + p for p in range(10))],
                      [[0, 1], [2, 3, 4], [5], [6, 7]], [40, 70, 5, 42], 3, [3, 13], [0, 1, 2, 12])  # fmt: skip


def test_the_native_last_layer_computes_only_the_rows_sampled_and_they_equal_the_whole_steps(loaded):
    runner = ModelRunner(loaded, EngineConfig(kv_cache_bytes=64 << 20, max_batch_size=8).for_device(loaded.device.type))
    layers = loaded.model.layers
    rows_seen: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda module, args, name=name: rows_seen[name].append(args[0].shape[0]))
        for name, layer in (("first", layers[0]), ("last", layers[-1]))
    ]
    step = _mixed_step()
    try:
        with torch.inference_mode():
            sampled = runner.forward(step)
            assert rows_seen == {"first": [13], "last": [4]}  # the prompt chunk's last row only, in the last
            whole = runner.forward(replace(step, sample_rows=list(range(len(step.ids)))))
    finally:
        for hook in hooks:
            hook.remove()
    assert rows_seen == {"first": [13, 13], "last": [4, 13]}  # every row, when every row is asked for
    torch.testing.assert_close(sampled, whole[step.sample_rows], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the CPU's cache comes from a memory map")
def test_the_cpu_kv_cache_is_zeros_made_resident_only_as_steps_touch_it(loaded):
    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE

    before = resident_bytes()
    runner = ModelRunner(loaded, EngineConfig(kv_cache_bytes=512 << 20).for_device("cpu"))
    grown = resident_bytes() - before
    assert grown < (512 << 20) // 4, grown  # torch.zeros would have written (and held) all 512 MiB
    with torch.inference_mode():
        runner.forward(_mixed_step())
    keys, values = runner._cache[0]
    touched = keys[:, 7]  # the prompt chunk's block: its 10 tokens written, the rest still zeros
    assert touched[:, :10].abs().sum() > 0 and touched[:, 10:].abs().sum() == 0
    assert keys[:, 100:].abs().sum() == 0 and values[:, 100:].abs().sum() == 0


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="waiting for a GPU is what this test looks for")
def test_a_step_waits_for_the_gpu_only_to_read_its_tokens(loaded):
    """Inputs and draws go up, the forward pass (graphed, and eager with a prompt chunk) and the sampler run,
    and nothing waits for the GPU until the tokens are read."""
    runner = ModelRunner(loaded, EngineConfig(kv_cache_bytes=64 << 20, max_batch_size=8).for_device(loaded.device.type))
    decode = StepLayout([5, 6, 7], [39, 69, 4], [39, 32 * 4 + 5, 32 * 5 + 4], [[0, 1], [2, 3, 4], [5]],
                        [40, 70, 5], 3, [], [0, 1, 2])  # fmt: skip
    mixed = StepLayout(decode.ids + list(range(10, 20)), decode.positions + list(range(32, 42)),
                       decode.slots + [32 * 7 + p for p in range(10)], [*decode.tables, [6, 7]],
                       [*decode.lengths, 42], 3, [3, 13], [0, 1, 2, 12])  # fmt: skip
    params = [
        SamplingParams(seed=1),
        SamplingParams(seed=2, do_sample=True, top_p=0.8, typical_p=0.7),
        SamplingParams(seed=3, repetition_penalty=1.3),
        SamplingParams(seed=4, do_sample=True, top_k=3),
    ]
    for step in (decode, mixed):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            draws = DrawBatch.of([Draw(p, (5, 6, 7), 3) for p in params[: len(step.sample_rows)]], 32000, TEST_DEVICE)
            tokens = choose(runner.head.logits(runner.forward(step)), draws)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(tokens.tolist()) == len(step.sample_rows)
    assert runner.graphed


def test_no_cuda_graphs_means_eager_decode_steps(loaded):
    config = EngineConfig(kv_cache_bytes=16 << 20, max_batch_size=2, attention="triton")
    graphed = ModelRunner(loaded, config.for_device(loaded.device.type), replay_eagerly)
    eager = ModelRunner(loaded, replace(config, cuda_graphs=False).for_device(loaded.device.type), replay_eagerly)
    assert graphed.graphed and not eager.graphed


def test_a_runner_profiles_allocates_and_captures_with_its_device_current(loaded, monkeypatch):
    """Triton launches on the current CUDA device, not on its tensors': a runner on cuda:1, built on a thread
    whose current device is 0, makes cuda:1 current for the kernels its constructor runs (the memory profile,
    the cache, the graphs' warm-up and capture). Here on the CPU, that context is recorded instead of entered."""
    assert current_cuda_device(torch.device("cuda", 1)).idx == 1
    assert isinstance(current_cuda_device(torch.device("cpu")), contextlib.nullcontext)
    current: list[torch.device] = []  # the devices made current, innermost last

    @contextlib.contextmanager
    def recorded(device: torch.device):
        current.append(device)
        yield
        current.pop()

    seen: list[tuple[str, tuple[torch.device, ...]]] = []  # (the work, the devices current while it ran)

    def profile(runner: ModelRunner, graphs: bool, draft) -> int:
        seen.append(("profile", tuple(current)))
        return 16 << 20

    allocate = ModelRunner._allocate

    def cache(runner: ModelRunner, blocks: int):
        seen.append(("cache", tuple(current)))
        return allocate(runner, blocks)

    def capture(run):
        seen.append(("capture", tuple(current)))
        return replay_eagerly(run)

    monkeypatch.setattr(model_runner, "current_cuda_device", recorded)
    monkeypatch.setattr(ModelRunner, "_gpu_kv_cache_bytes", profile)  # what a GPU's unsized cache runs
    monkeypatch.setattr(ModelRunner, "_allocate", cache)
    config = EngineConfig(max_batch_size=2, attention="triton").for_device(loaded.device.type)
    runner = ModelRunner(loaded, replace(config, kv_cache_bytes=None), capture)
    assert runner.graphed and not current
    assert {work for work, _ in seen} == {"profile", "cache", "capture"}
    assert all(devices == (loaded.device,) for _, devices in seen), seen


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="GPU memory")
def test_on_a_gpu_the_kv_cache_takes_its_fraction_of_the_free_memory(loaded):
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(TEST_DEVICE)[0]
    runner = ModelRunner(loaded, EngineConfig(gpu_memory_fraction=0.05, max_batch_size=16).for_device(TEST_DEVICE.type))
    kv_bytes = runner.num_blocks * runner.block_size * KVGeometry.of(loaded.model).bytes_per_token
    assert 0.03 * free < kv_bytes <= 0.05 * free  # less what an eager step and the graphs take


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


def test_ignore_eos_generates_every_token_asked_for(harness):
    request_id = harness.submit(PROMPTS[0], 30, ignore_eos=True)
    events = harness.collect([request_id])[request_id]
    assert len(_tokens(events)) == 30 and events[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_keeps_eos_and_stop_tokens_from_being_drawn_until_then(loaded, harness):
    eos_at = len(harness.collect([r := harness.submit(PROMPTS[0], 50)])[r]) - 1
    early = _tokens(harness.collect([r := harness.submit(PROMPTS[0], 8, ignore_eos=True)])[r])
    events = harness.collect([r := harness.submit(PROMPTS[0], 50, min_tokens=eos_at + 5, stop_token_ids=early[:2])])[r]
    tokens = _tokens(events)
    assert len(tokens) > eos_at + 5 and not set(tokens[: eos_at + 5]) & (loaded.eos_token_ids | set(early[:2]))


def test_batch_size_counts_the_sequences_of_the_step(harness):
    ids = [harness.submit(LONG, 30) for _ in range(4)]
    results = harness.collect(ids)
    assert max(e.batch_size for events in results.values() for e in events) == 4


def test_a_seeded_request_draws_the_same_tokens_alone_in_a_batch_after_preemption_and_elsewhere(loaded, harness_with):
    sampling = dict(do_sample=True, temperature=1.3, top_k=50, seed=4242)
    prompt = list(range(100, 196))  # 96 tokens: three blocks
    alone = harness_with()
    reference_tokens = _tokens(alone.collect([rid := alone.submit(prompt, 40, **sampling)])[rid])

    crowd = [alone.submit(p, 25, seed=i + 1, do_sample=True) for i, p in enumerate(PROMPTS * 8)]
    in_batch = alone.submit(prompt, 40, **sampling)
    assert _tokens(alone.collect(crowd + [in_batch])[in_batch]) == reference_tokens

    # Eight blocks: the request fits alone, but not beside two urgent ones, which preempt it.
    tight = harness_with(max_seq_len=256, kv_cache_bytes=8 * BLOCK_BYTES_F64)
    preempted = tight.submit(prompt, 40, priority=5, **sampling)
    tight.wait_for_tokens(preempted, 5)
    urgent = [tight.submit(list(range(300 + i, 400 + i)), 8, priority=1) for i in range(2)]
    results = tight.collect([preempted, *urgent])
    assert tight.engine.stats()["preemptions"] >= 1
    assert _tokens(results[preempted]) == reference_tokens

    elsewhere = Harness(
        load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64"), EngineConfig(kv_cache_bytes=64 << 20)
    )
    try:
        assert _tokens(elsewhere.collect([rid := elsewhere.submit(prompt, 40, **sampling)])[rid]) == reference_tokens
    finally:
        elsewhere.close()


def test_a_failover_continues_from_the_delivered_tokens_with_the_same_tokens_and_text(loaded, harness):
    sampling = dict(do_sample=True, temperature=1.3, top_k=50, seed=77)
    prompt = "Unicode: \u00e9t\u00e9, \u65e5\u672c\u8a9e, "
    reference_events = harness.collect([rid := harness.submit(prompt, 40, ignore_eos=True, **sampling)])[rid]
    reference_tokens = _tokens(reference_events)
    for delivered in (1, 17, 39):
        rid = harness.submit(prompt, 40, generated=reference_tokens[:delivered], ignore_eos=True, **sampling)
        resumed = harness.collect([rid])[rid]
        assert resumed[0].index == delivered and resumed[0].prefill_time_ms is None
        assert _tokens(resumed) == reference_tokens[delivered:], delivered
        text_before = "".join(e.text for e in reference_events[:delivered])
        assert text_before + "".join(e.text for e in resumed) == "".join(e.text for e in reference_events)
    # Every token was delivered but the last event was lost: the failover only ends the request.
    [done] = harness.collect([rid := harness.submit(prompt, 40, generated=reference_tokens, **sampling)])[rid]
    assert done.token_ids == [] and done.index == 40 and done.finish_reason == FinishReason.LENGTH


def _logprobs(reference, token_ids: list[int]) -> torch.Tensor:
    """transformers' own forward pass: log-softmax of the logits at every position [tokens, vocabulary]."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([token_ids], device=reference.device)).logits[0]
    return logits.double().log_softmax(dim=-1).cpu()


def test_log_probabilities_are_the_models_own_for_generated_and_prompt_tokens(loaded, reference, harness_with):
    """Raw log-softmax, whatever the sampling did: in a batch, over chunked prompts, and after a failover."""
    h = harness_with(max_tokens_per_step=8)  # the 10-token prompt comes in two chunks
    prompt = loaded.tokenizer(PROMPTS[2])["input_ids"][:10]
    sampled = dict(do_sample=True, temperature=1.7, top_k=20, seed=5, ignore_eos=True)
    ids = [
        h.submit(prompt, 12, logprobs=5, prompt_logprobs=3, ignore_eos=True),  # greedy
        h.submit(prompt, 12, logprobs=0, repetition_penalty=1.5, **sampled),
        h.submit(PROMPTS[0], 12),  # asks for nothing, in the same steps
    ]
    results = h.collect(ids)
    greedy, sampled_events, plain = (results[i] for i in ids)
    assert all(e.logprobs is None and e.prompt is None for e in plain)
    tokens = _tokens(greedy)
    expected = _logprobs(reference, prompt + tokens)
    for position, event in enumerate(greedy):
        [info] = event.logprobs
        row = expected[len(prompt) - 1 + position]
        assert info.id == tokens[position] and info.logprob == pytest.approx(row[info.id].item(), abs=1e-9)
        assert [t.id for t in info.top] == row.topk(5).indices.tolist()
        assert info.top[0].id == info.id and info.top[0].logprob == info.logprob  # greedy: the likeliest
        assert [t.logprob for t in info.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-9)
    listed = greedy[0].prompt
    assert [t.id for t in listed] == prompt and listed[0].logprob is None and listed[0].top == []
    for position, info in enumerate(listed[1:], start=1):
        row = expected[position - 1]
        assert info.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-9), position
        assert [t.id for t in info.top] == row.topk(3).indices.tolist()
    assert all(e.prompt is None for e in greedy[1:])
    # Sampling with a temperature and a penalty: still the model's raw log-probabilities, no alternatives.
    drawn = _tokens(sampled_events)
    raw = _logprobs(reference, prompt + drawn)
    for position, event in enumerate(sampled_events):
        [info] = event.logprobs
        assert info.top == [] and info.logprob == pytest.approx(
            raw[len(prompt) - 1 + position][info.id].item(), abs=1e-9
        )
    # A failover after 5 tokens: the resumed tokens' log-probabilities are the uninterrupted run's.
    resumed = h.collect([r := h.submit(prompt, 12, generated=tokens[:5], logprobs=5, ignore_eos=True)])[r]
    assert _tokens(resumed) == tokens[5:]
    for before, after in zip(greedy[5:], resumed, strict=True):
        assert after.logprobs[0].logprob == pytest.approx(before.logprobs[0].logprob, abs=1e-9)
        assert [t.id for t in after.logprobs[0].top] == [t.id for t in before.logprobs[0].top]


def test_a_grammar_shapes_sampled_text_and_a_cancel_while_it_compiles_ends_the_request(harness):
    """The first grammar compiles with the tokenizer's conversion (~0.2 s): a cancel lands meanwhile."""
    grammar = LLMatcher.grammar_from_regex(r"(red|green|blue)( (red|green|blue)){2}")
    cancelled = harness.submit(PROMPTS[0], 30, do_sample=True, grammar=grammar)
    harness.engine.cancel(cancelled)
    [stopped] = harness.collect([cancelled])[cancelled]
    assert stopped.token_ids == [] and stopped.finish_reason == FinishReason.STOP_SEQUENCE
    ids = [harness.submit(PROMPTS[i % 4], 30, do_sample=True, seed=i, grammar=grammar) for i in range(6)]
    for events in harness.collect(ids).values():
        text = "".join(e.text for e in events)
        assert re.fullmatch(r"(red|green|blue)( (red|green|blue)){2}", text), text
        assert events[-1].finish_reason == FinishReason.EOS_TOKEN  # the grammar complete, EOS is all it allows


def test_a_stop_string_ends_generation_before_it_and_a_stop_token_with_it(harness):
    reference = harness.collect([rid := harness.submit(LONG, 40, ignore_eos=True)])[rid]
    text = "".join(e.text for e in reference)
    stop = text[20:24]
    events = harness.collect([rid := harness.submit(LONG, 40, ignore_eos=True, stop=[stop, "\u00a7never"])])[rid]
    assert "".join(e.text for e in events) == text[: text.index(stop)]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE and len(events) < 40
    stop_token = _tokens(reference)[6]
    events = harness.collect([rid := harness.submit(LONG, 40, ignore_eos=True, stop_token_ids=[stop_token])])[rid]
    first = _tokens(reference).index(stop_token)
    assert _tokens(events) == _tokens(reference)[: first + 1]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE


def test_cancel_ends_the_request_within_a_step(harness):
    request_id = harness.submit(LONG, 500)
    harness.wait_for_tokens(request_id, 1)
    harness.engine.cancel(request_id)
    events = harness.collect([request_id])[request_id]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE
    assert events[-1].token_ids == []
    assert len(events) < 50


def test_an_urgent_request_arriving_during_a_step_is_computed_within_it_with_the_tokens_it_has_alone(loaded, harness):
    background_prompts = [PROMPTS[1], PROMPTS[3]] * 2
    urgent_prompt = PROMPTS[2]
    ids = [harness.submit(p, 30) for p in background_prompts]
    batch = harness.collect(ids)
    background_alone = [_tokens(batch[i]) for i in ids]
    urgent_alone = _tokens(harness.collect([rid := harness.submit(urgent_prompt, 8, priority=1)])[rid])

    # The urgent request arrives between the layers of the step after the background's first two.
    arrived_after: list[int] = []  # events out before it arrived
    urgent_id: list[str] = []

    def arrive_during_step(layer, args) -> None:
        if not arrived_after and harness.events.qsize() >= 2 * len(background_prompts):
            arrived_after.append(harness.events.qsize())
            urgent_id.append(harness.submit(urgent_prompt, 8, priority=1))

    hook = loaded.decoder().layers[1].register_forward_pre_hook(arrive_during_step)
    try:
        ids = [harness.submit(p, 30) for p in background_prompts]
        deadline = time.monotonic() + 120
        while not urgent_id:
            assert time.monotonic() < deadline, "no step came to the urgent request's arrival"
            time.sleep(0.01)
        order: list[TokenEvent] = []
        while {e.request_id for e in order if e.finish_reason is not None} != {*ids, urgent_id[0]}:
            order.append(harness.events.get(timeout=60))
    finally:
        hook.remove()
    # Its first token comes out before the tokens of the step it arrived in.
    first = order[arrived_after[0]]
    assert (first.request_id, first.index) == (urgent_id[0], 0)
    # Neither it nor the step it interrupted computed anything other than on their own.
    assert _tokens([e for e in order if e.request_id == urgent_id[0]]) == urgent_alone
    assert [_tokens([e for e in order if e.request_id == i]) for i in ids] == background_alone


def test_max_iter_times_caps_max_new_tokens(harness_with):
    h = harness_with(max_iter_times=3)
    request_id = h.submit(LONG, 100)
    events = h.collect([request_id])[request_id]
    assert len(_tokens(events)) == 3 and events[-1].finish_reason == FinishReason.LENGTH


def test_max_seq_len_ends_generation(harness_with):
    h = harness_with(max_seq_len=12)
    request_id = h.submit(list(range(100, 110)), 100)  # 10 prompt tokens: 2 more reach 12
    events = h.collect([request_id])[request_id]
    assert len(_tokens(events)) == 2 and events[-1].finish_reason == FinishReason.LENGTH


def test_prompt_longer_than_allowed_is_refused_with_424(harness_with):
    h = harness_with(max_input_len=8)
    request_id = h.submit(list(range(100, 109)), 4)
    [event] = h.collect([request_id])[request_id]
    assert event.error.status == 424 and event.error.error_type == "Generation Error"
    assert "9 tokens" in event.error.message and "at most 8" in event.error.message


def test_token_id_outside_the_vocabulary_is_refused_with_424(harness):
    request_id = harness.submit([5, 32000], 4)
    [event] = harness.collect([request_id])[request_id]
    assert event.error.status == 424
    assert "32000" in event.error.message and "[0, 32000)" in event.error.message


def _answer(harness: Harness, task: str, **prompt) -> TokenEvent:
    """The one event of a tokenize or detokenize request."""
    request_id = uuid.uuid4().hex
    request = EngineRequest(
        request_id=request_id, sampling=SamplingParams(seed=0), deadline=time.time() + 60, task=task, **prompt
    )
    harness.engine.submit(request, time.monotonic())
    [event] = harness.collect([request_id])[request_id]
    return event


def test_tokenize_and_detokenize_are_answered_between_steps_with_the_tokenizers_own_tokens(loaded, harness):
    tokenizer = loaded.tokenizer
    running = harness.submit(LONG, 40)  # a generation in flight: the answers come between its steps
    harness.wait_for_tokens(running, 1)
    text = "Hello wörld, 日本"
    encoded = tokenizer(text, return_offsets_mapping=True)
    event = _answer(harness, "tokenize", prompt_text=text)
    assert [t.id for t in event.tokens] == encoded["input_ids"] and event.prompt_tokens == len(encoded["input_ids"])
    assert [t.token for t in event.tokens] == tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    assert [(t.start, t.stop) for t in event.tokens] == encoded["offset_mapping"]
    assert event.finish_reason == FinishReason.LENGTH and event.token_ids == [] and event.error is None
    bare = _answer(
        harness, "tokenize", prompt_text=text, tokenization=Tokenization(add_special_tokens=False), truncate=3
    )
    assert [t.id for t in bare.tokens] == tokenizer(text, add_special_tokens=False)["input_ids"][-3:]

    chat = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="Hello")]
    dicts = [m.model_dump(exclude_none=True) for m in chat]
    open_ended = Tokenization(add_special_tokens=False, add_generation_prompt=False, continue_final_message=True)
    event = _answer(harness, "tokenize", chat_messages=chat, tokenization=open_ended)
    expected = tokenizer.apply_chat_template(dicts, continue_final_message=True, tokenize=True)["input_ids"]
    assert [t.id for t in event.tokens] == expected and {(t.start, t.stop) for t in event.tokens} == {(None, None)}
    as_generated = _answer(harness, "tokenize", chat_messages=chat)  # no options: the template's generation prompt
    expected = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert [t.id for t in as_generated.tokens] == expected

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert _answer(harness, "detokenize", prompt_token_ids=ids).text == text
    assert _answer(harness, "detokenize", prompt_token_ids=encoded["input_ids"]).text == "<s>" + text
    refused = _answer(harness, "detokenize", prompt_token_ids=[5, 32000])
    assert (
        refused.error.status == 424 and "token id 32000 is outside the vocabulary [0, 32000)" in refused.error.message
    )
    assert harness.collect([running])[running][-1].finish_reason is not None  # the generation went on undisturbed


def test_tokenize_keeps_the_prompt_limit(harness_with):
    h = harness_with(max_input_len=8)
    event = _answer(h, "tokenize", prompt_token_ids=list(range(100, 109)))
    assert event.error.status == 424 and "9 tokens" in event.error.message and "at most 8" in event.error.message


def test_a_request_past_its_deadline_ends_with_a_timeout(harness):
    request_id = harness.submit(LONG, 500, timeout_s=0.3)
    events = harness.collect([request_id])[request_id]
    assert events[-1].finish_reason == FinishReason.STOP_SEQUENCE
    assert events[-1].error.status == 504 and events[-1].error.error_type == "Timeout"


def test_batch_step_and_cache_sizes_default_per_device_and_settings_given_stay():
    cpu, gpu = EngineConfig().for_device("cpu"), EngineConfig().for_device("cuda")
    assert (cpu.max_batch_size, cpu.max_tokens_per_step, cpu.kv_cache_bytes) == (64, 1024, 1 << 30)
    assert (gpu.max_batch_size, gpu.max_tokens_per_step, gpu.kv_cache_bytes) == (256, 2048, None)
    given = EngineConfig(max_batch_size=8, max_tokens_per_step=100, kv_cache_bytes=5).for_device("cuda")
    assert (given.max_batch_size, given.max_tokens_per_step, given.kv_cache_bytes) == (8, 100, 5)


def test_a_cache_smaller_than_max_seq_len_is_refused(loaded):
    with pytest.raises(ValueError, match="fewer than max_seq_len 2560"):
        Engine(loaded, EngineConfig(kv_cache_bytes=10 * BLOCK_BYTES_F64), lambda events: None)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_family_models_equal_transformers_generate(family, loaded):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        family,
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(0)
    engine_model = random_model(config, loaded.tokenizer, str(TEST_DEVICE), "float64")
    torch.manual_seed(0)
    reference = random_model(config, loaded.tokenizer, str(TEST_DEVICE), "float64", model_impl="transformers")
    h = Harness(engine_model, EngineConfig(max_seq_len=1024, kv_cache_bytes=16 << 20))
    try:
        prompts = [list(range(10, 10 + n)) for n in (3, 40, 77)]
        ids = [h.submit(p, 12) for p in prompts]
        results = h.collect(ids)
    finally:
        h.close()
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert _tokens(results[request_id]) == _reference(reference, prompt, 12)


def test_a_nan_output_ends_its_sequence_with_an_error_and_the_rest_of_the_batch_goes_on(monkeypatch):
    """The CPU's fast greedy head (float32 weights) finds no argmax candidate in a NaN row: that row's token was
    the vocabulary size, an invalid id on which the next step failed, failing every request in it."""
    monkeypatch.setattr(model_runner, "OutputHead", functools.partial(OutputHead, fast=True))
    loaded = load_model(str(BUNDLED_MODEL), "cpu", "float32")  # weights of its own: one embedding is made NaN
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    h = Harness(loaded, EngineConfig(kv_cache_bytes=64 << 20))
    try:
        alone = [h.collect([r := h.submit(p, 8)])[r] for p in prompts[:2]]
        _poison_embedding(loaded.model, next(t for t in prompts[2] if all(t not in other for other in prompts[:2])))
        with structlog.testing.capture_logs() as logs:
            ids = [h.submit(p, 8) for p in prompts]
            results = h.collect(ids)
    finally:
        h.close()
    assert [_tokens(results[r]) for r in ids[:2]] == [_tokens(events) for events in alone]
    [ended] = results[ids[2]]
    assert ended.finish_reason == FinishReason.INVALID_FLAG and not ended.token_ids
    assert ended.error.status == 500 and "the model's output was NaN" in ended.error.message
    assert [entry["request_id"] for entry in logs if entry["event"] == "output_nan"] == [ids[2]]


def _poison_embedding(model: torch.nn.Module, token: int) -> None:
    """The token's input embedding NaN, so that a sequence holding it has NaN hidden states; the output head,
    which the bundled models tie to it, keeps its own weights."""
    embedding = model.get_input_embeddings()
    embedding.weight = torch.nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        embedding.weight[token] = float("nan")
