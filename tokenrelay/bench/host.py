"""`tokenrelay bench host`: the engine's host work per step, and how much of a device's time it leaves idle.

A GPU's tokens/s is bounded by the slower of its step and the host's work
around it: scheduling, block tables, input tensors, the sampler's set-up,
detokenizing, events. Both are measured here, on the CPU. The engine runs
unchanged around the simulated runner (workers/simulated/), whose step is a
wait, on the engine bench's workload shape (random prompts of --prompt-lens
tokens, --output-lens new tokens each, all arriving at once) at
--max-batch-size:

- zero_cost: a profile whose steps cost nothing, so the wall time per step
  is the host's alone (and per sequence in the step);
- device: a device's profile (--profile, default llama-1.1b-h200), and the
  share of the run's wall time its steps took (the device's utilization):
  what the host leaves of a GPU;
- runner: the real ModelRunner around a model whose compute is negligible
  (1 layer, hidden 64, vocabulary 512, made at run time): its seconds per
  step are its own host work (input ids, positions, block tables, slots, the
  sampler's set-up, the tokens copied out), beside the engine's around it.

--requests defaults to 4 times the batch, so that most steps run a full
batch; each figure says its steps' mean batch. Each part runs --repeat
times and the best run counts (least host time): on a shared machine a
noisy spell would otherwise decide.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import dataclass, replace

from tokenrelay.bench.engine_runs import engine_pass, workload
from tokenrelay.bench.help import HelpFormatter, add_length_range
from workers.bundled import BUNDLED_MODEL
from workers.simulated.profile import Profile, StepCost
from workers.simulated.profile import names as profile_names

NEGLIGIBLE_MODEL = dict(  # a Llama whose step computes next to nothing: the runner's time is its host work
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=512,
    max_position_embeddings=4096,
)


class _TimedRunner:
    """A runner whose steps are counted and timed: their rows, and the seconds each `execute` took."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.steps = self.rows = 0
        self.execute_s = 0.0

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, chunks, drawing):
        started = time.perf_counter()
        try:
            return self._runner.execute(chunks, drawing)
        finally:
            self.execute_s += time.perf_counter() - started
            self.steps += 1
            self.rows += len(chunks)


class _Watched:
    """A model (simulated or loaded) whose runner is a _TimedRunner the bench keeps."""

    def __init__(self, model) -> None:
        self._model = model
        self.timed: _TimedRunner | None = None

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def runner(self, config, capture=None, draft=None):
        self.timed = _TimedRunner(self._model.runner(config, capture, draft))
        return self.timed


@dataclass
class Run:
    steps: int
    mean_batch: float
    seconds: float
    output_tokens: int
    execute_s: float  # in the runner's execute
    device_s: float  # the simulated device's step time (the profile's); the runner's execute for a real one

    @property
    def host_ms_per_step(self) -> float:
        return round((self.seconds - self.device_s) * 1000 / self.steps, 3)

    def report(self) -> dict:
        host_s = self.seconds - self.device_s
        return {
            "steps": self.steps,
            "mean_batch": round(self.mean_batch, 1),
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.output_tokens / self.seconds, 1),
            "host_ms_per_step": self.host_ms_per_step,
            "host_us_per_sequence_step": round(host_s * 1e6 / (self.steps * self.mean_batch), 2),
            "utilization": round(self.device_s / self.seconds, 3),
        }


def measure(model, config, requests) -> Run:
    """One engine over `requests` (after a warm-up of two): its steps, and where their time went."""
    from workers.engine.engine import Engine

    watched = _Watched(model)
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = Engine(watched, config, lambda batch: events.put((time.perf_counter(), batch)))
    engine.start()
    try:
        engine_pass(engine, events, requests[:2])
        before = _counts(watched.timed)
        started = time.perf_counter()
        engine_pass(engine, events, requests)
        seconds = time.perf_counter() - started
        steps, rows, execute_s, device_s = (
            now - then for now, then in zip(_counts(watched.timed), before, strict=True)
        )
    finally:
        engine.stop()
    return Run(steps, rows / steps, seconds, sum(r.output_len for r in requests), execute_s, device_s)


def _counts(timed: _TimedRunner) -> tuple[int, int, float, float]:
    """Steps, rows and seconds in execute so far, and the device's time: a simulated runner's (its profile's),
    else the execute's."""
    return timed.steps, timed.rows, timed.execute_s, getattr(timed, "busy_s", timed.execute_s)


def simulated(profile, args) -> dict:
    from workers.engine.config import EngineConfig
    from workers.simulated.model import VOCAB_SIZE, SimulatedModel

    model = SimulatedModel(profile)
    config = model.engine_config(EngineConfig(max_batch_size=args.max_batch_size))
    requests = workload(args.requests, args.prompt_lens, args.output_lens, VOCAB_SIZE, args.seed)
    runs = [measure(model, config, requests) for _ in range(args.repeat)]
    best = min(runs, key=lambda run: run.host_ms_per_step)
    return {"profile": profile.name, **best.report(), "runs_host_ms_per_step": [run.host_ms_per_step for run in runs]}


def negligible_runner(args) -> dict:
    """The real ModelRunner's part: its execute per step, and the engine's host work beside it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig

    from workers.engine.config import EngineConfig
    from workers.engine.model_loader import random_model

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)  # its ids below 512 decode as the bundled model's
    model = random_model(LlamaConfig(**NEGLIGIBLE_MODEL), tokenizer, device="cpu", dtype="float32")
    config = EngineConfig(max_batch_size=args.max_batch_size)
    requests = workload(args.requests, args.prompt_lens, args.output_lens, NEGLIGIBLE_MODEL["vocab_size"], args.seed)
    runs = [measure(model, config, requests) for _ in range(args.repeat)]
    runner_ms = [round(run.execute_s * 1000 / run.steps, 3) for run in runs]
    best = runs[runner_ms.index(min(runner_ms))]
    # Its host_ms_per_step is the engine's host work beside the runner, its utilization the runner's share.
    return {**best.report(), "runner_ms_per_step": min(runner_ms), "runs_runner_ms_per_step": runner_ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenrelay bench host", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--max-batch-size", type=int, default=256, help="sequences per step, at most")
    parser.add_argument("--requests", type=int, default=0, help="requests, all arriving at once; 0: 4x the batch")
    add_length_range(parser, "prompt-lens", (32, 512), "prompt tokens, drawn per request")
    add_length_range(parser, "output-lens", (16, 256), "new tokens, drawn per request")
    parser.add_argument("--profile", default="llama-1.1b-h200", choices=profile_names(), help="the device's profile")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each part; the best counts")
    parser.add_argument("--seed", type=int, default=0, help="of the workload")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["zero_cost", "device", "runner"], help="parts not to run"
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    args.requests = args.requests or 4 * args.max_batch_size
    device = Profile.load(args.profile)
    parts = {
        "zero_cost": lambda: simulated(replace(device, name="zero-cost", step=StepCost(0.0, 0.0, 0.0, 0.0)), args),
        "device": lambda: simulated(device, args),
        "runner": lambda: negligible_runner(args),
    }
    result: dict = {"max_batch_size": args.max_batch_size, "requests": args.requests}
    for name, part in parts.items():
        if name in args.skip:
            continue
        result[name] = part()
        print(_line(name, result[name]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result), flush=True)


def _line(name: str, part: dict) -> str:
    shape = f"{part['steps']} steps of {part['mean_batch']} sequences on average, {part['tokens_per_s']} tok/s"
    if name == "runner":
        return (
            f"runner (negligible model): its execute {part['runner_ms_per_step']} ms per step, the engine's host "
            f"work beside it {part['host_ms_per_step']} ms ({shape})"
        )
    host = f"host {part['host_ms_per_step']} ms per step ({part['host_us_per_sequence_step']} us per sequence)"
    runs = ", ".join(map(str, part["runs_host_ms_per_step"]))
    if name == "zero_cost":
        return f"zero-cost steps: {host}; runs {runs} ms ({shape})"
    return f"{part['profile']}: device utilization {part['utilization']}, {host} ({shape})"


if __name__ == "__main__":
    main()
