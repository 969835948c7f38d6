"""`tokenrelay bench profile`: measure a model's step times and write a simulation profile.

Times decode steps (batch sizes by contexts) and prompt steps (one chunk of
n tokens) as the engine's runner computes them, fits the step-time model of
workers/simulated/profile.py by least squares, prints measured against
fitted times, and writes the profile where --out says.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenrelay.bench.help import HelpFormatter
from workers.bundled import BUNDLED_MODEL
from workers.simulated.profile import Profile, StepCost

# torch and the engine are imported where they are used, so that `--help` answers at once.
if TYPE_CHECKING:
    import torch

    from workers.engine.model_runner import ModelRunner, StepLayout


def prompt_layout(tokens: int, block_size: int, vocab: int) -> StepLayout:
    """One prompt of `tokens` tokens in fresh blocks, computed in one chunk."""
    from workers.engine.model_runner import StepLayout

    blocks = -(-tokens // block_size)
    ids = [(7 * i) % vocab for i in range(tokens)]
    return StepLayout(
        ids, list(range(tokens)), list(range(tokens)), [list(range(blocks))], [tokens], 0, [0, tokens], [tokens - 1]
    )


def measure(runner: ModelRunner, device: torch.device, repeats: int) -> list[tuple[int, int, int, float]]:
    """(prefill tokens, decoding sequences, context tokens, seconds) per step shape measured."""
    from schemas.messages import SamplingParams
    from tokenrelay.bench.decode_step import decode_layout, median_step_ms
    from workers.engine.sampler import Draw, DrawBatch

    vocab = runner.head.vocab_size
    shapes = [
        (decode_layout([c] * b, runner.block_size, vocab), 0, b, b * c) for b in (1, 8, 32, 64) for c in (128, 1024)
    ]
    shapes += [(prompt_layout(n, runner.block_size, vocab), n, 0, n) for n in (64, 256, 1024)]
    rows = []
    for step, prompt, decodes, context in shapes:
        draws = DrawBatch.of([Draw(SamplingParams(seed=0), (), 0)] * len(step.sample_rows), vocab, device)
        seconds = median_step_ms(runner, step, draws, False, repeats) / 1000
        rows.append((prompt, decodes, context, seconds))
        print(
            f"  prompt {prompt:5d}  decoding {decodes:3d}  context {context:6d}  {seconds * 1000:8.2f} ms", flush=True
        )
    return rows


def fit(rows: list[tuple[int, int, int, float]]) -> StepCost:
    import torch

    features = torch.tensor([[1.0, p, d, c] for p, d, c, _ in rows], dtype=torch.float64)
    seconds = torch.tensor([[s] for *_, s in rows], dtype=torch.float64)
    # Relative error counts, not absolute: weigh each step by its own time.
    weights = 1 / seconds
    solution = torch.linalg.lstsq(features * weights, seconds * weights).solution.flatten().clamp(min=0).tolist()
    return StepCost(*solution)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench profile", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--model", default=str(BUNDLED_MODEL), help="model directory; default: the bundled model")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    parser.add_argument("--name", default="bundled-cpu", help="the profile's name")
    parser.add_argument("--repeats", type=int, default=10, help="timings of each step shape; their median counts")
    parser.add_argument("--out", default="", help="where to write the profile (JSON); empty: stdout only")
    args = parser.parse_args(argv)

    import torch

    from workers.engine.config import EngineConfig
    from workers.engine.model_loader import load_model
    from workers.engine.model_runner import ModelRunner

    loaded = load_model(args.model, args.device)
    config = EngineConfig().for_device(loaded.device.type)
    runner = ModelRunner(loaded, config)
    print(f"step times of {args.model} on {loaded.device} ({platform.processor() or platform.machine()}):")
    rows = measure(runner, loaded.device, args.repeats)
    cost = fit(rows)
    print("fitted:", cost)
    for prompt, decodes, context, seconds in rows:
        print(f"  measured {seconds * 1000:8.2f} ms  fitted {cost.seconds(prompt, decodes, context) * 1000:8.2f} ms")
    today = datetime.date.today().isoformat()
    model = "the bundled model" if args.model == str(BUNDLED_MODEL) else args.model
    machine = (
        f"{os.cpu_count()} CPU cores" if loaded.device.type == "cpu" else torch.cuda.get_device_name(loaded.device)
    )
    profile = Profile(
        name=args.name,
        source=f"measured: tokenrelay bench profile, {model} on {machine}, {today}",
        max_batch_size=config.max_batch_size,
        max_tokens_per_step=config.max_tokens_per_step,
        kv_cache_tokens=runner.num_blocks * runner.block_size,
        step=cost,
    )
    if args.out:
        profile.dump(Path(args.out))
        print(f"written to {args.out}")
    else:
        sys.stdout.write(str(profile) + "\n")
