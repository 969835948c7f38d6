"""How long one decode step takes, eager and graphed, against what the memory's bandwidth allows.

A decode step reads every weight once and every cached key and value of
its batch once; that is most of its memory traffic, and at small batches
the step is bound by it. For batch sizes b, a step of b sequences whose
contexts are the workload's (prompt plus half the output: the middle of
generation) is timed as the engine runs it (inputs up, forward pass, logits,
argmax, tokens down), once with CUDA graphs off and once replayed from them;
the bound is those bytes over the device's copy bandwidth, measured here.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from schemas.messages import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.model_loader import LoadedModel
from workers.engine.model_runner import KVGeometry, ModelRunner, StepLayout
from workers.engine.sampler import Draw, DrawBatch, sample


@dataclass
class StepTiming:
    batch: int
    mean_context: int
    eager_ms: float
    graphed_ms: float | None  # None: no CUDA graphs here (CPU, or --no-cuda-graphs)
    bound_ms: float  # bytes read / copy bandwidth
    eager_over_bound: float
    graphed_over_bound: float | None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock reading means it is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large on-device copy moves (each byte read once and written once): 1 GiB on a GPU,
    whose caches hold tens of MiB; 256 MiB on a CPU, whose caches hold a few."""
    source = torch.empty((2**30 if device.type == "cuda" else 2**28) // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm up
    sync(device)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / min(times)


def decode_bytes(loaded: LoadedModel, contexts: list[int]) -> int:
    """The weights a decode step reads (an untied input embedding only by the rows it looks up), plus the
    keys and values of these contexts."""
    model = loaded.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        weights -= embedding.numel() * embedding.element_size()
    return weights + sum(contexts) * KVGeometry.of(model).bytes_per_token


def decode_layout(contexts: list[int], block_size: int, vocab: int) -> StepLayout:
    """b sequences in consecutive fresh blocks, each decoding the token at its context's last position."""
    tables, slots, next_block = [], [], 0
    for context in contexts:
        blocks = -(-context // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        tables.append(table)
        slots.append(table[(context - 1) // block_size] * block_size + (context - 1) % block_size)
    ids = [(7 * i) % vocab for i in range(len(contexts))]
    positions = [c - 1 for c in contexts]
    return StepLayout(ids, positions, slots, tables, contexts, len(contexts), [], list(range(len(contexts))))


def median_step_ms(runner: ModelRunner, step: StepLayout, draws: DrawBatch, graphs: bool, repeats: int) -> float:
    """The median time of the step, as the engine runs it, ending when its tokens are read."""
    for _ in range(3):
        sample(runner.head, runner.forward(step, graphs=graphs), draws)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sample(runner.head, runner.forward(step, graphs=graphs), draws)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def time_decode_steps(
    loaded: LoadedModel, config: EngineConfig, contexts_by_batch: dict[int, list[int]], repeats: int = 20, out=None
) -> list[StepTiming]:
    """A StepTiming per batch size, printed to `out` as each is measured."""
    device = loaded.device
    bandwidth = copy_bandwidth(device)
    config = config.for_device(device.type)
    runner = ModelRunner(loaded, config)
    if out is not None:
        print(f"decode steps (copy bandwidth {bandwidth / 1e9:.1f} GB/s):", file=out, flush=True)
    timings = []
    for batch, contexts in contexts_by_batch.items():
        needed = sum(-(-c // runner.block_size) for c in contexts)
        if needed > runner.num_blocks:
            if out is not None:
                print(f"  batch {batch}: skipped, {needed} blocks > the cache's {runner.num_blocks}", file=out)
            continue
        step = decode_layout(contexts, runner.block_size, runner.head.vocab_size)
        draws = DrawBatch.of([Draw(SamplingParams(seed=0), (), 0)] * batch, runner.head.vocab_size, device)
        eager = median_step_ms(runner, step, draws, False, repeats)
        graphed = None
        if runner.graphed and batch <= config.max_batch_size:
            graphed = median_step_ms(runner, step, draws, True, repeats)
        bound = decode_bytes(loaded, contexts) / bandwidth * 1000
        timing = StepTiming(
            batch=batch,
            mean_context=round(statistics.mean(contexts)),
            eager_ms=round(eager, 3),
            graphed_ms=None if graphed is None else round(graphed, 3),
            bound_ms=round(bound, 3),
            eager_over_bound=round(eager / bound, 2),
            graphed_over_bound=None if graphed is None else round(graphed / bound, 2),
        )
        timings.append(timing)
        if out is not None:
            graphed_text = "—" if graphed is None else f"{graphed:8.2f} ms ({graphed / bound:5.2f}x bound)"
            print(
                f"  batch {batch:4d}  context {timing.mean_context:5d}  eager {eager:8.2f} ms "
                f"({eager / bound:5.2f}x bound)  graphed {graphed_text}  bound {bound:7.3f} ms",
                file=out,
                flush=True,
            )
    return timings
