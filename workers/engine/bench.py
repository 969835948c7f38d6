"""`tokenrelay bench engine`: the engine against transformers' own ways to generate, in one run.

A fixed seeded workload (random prompt token ids and output lengths, all
requests arriving at once, greedy, EOS ignored so every method generates the
same tokens) goes through
- the engine (continuous batching over the paged KV cache), and, as baselines,
- transformers `generate`, one request at a time (the first 16: too slow whole),
- transformers `generate` on left-padded static batches of the engine's batch size,
- transformers' own continuous batching (`init_continuous_batching`; the first 128).
Each reports output tokens/s, time to first token (from the run's start) at
p50/p99, and time per output token; the ratios are the engine's tokens/s over
each baseline's. The engine and static batches, the closest pair, run
`--repeat` times each, interleaved, and the best run of each counts: on a
shared machine a noisy spell during one of them would otherwise decide the
ratio.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LogitsProcessor, LogitsProcessorList

from schemas.messages import GenerationRequest, SamplingParams
from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.model_loader import LoadedModel, load_model, random_model

# A ~1.1 B parameter Llama (TinyLlama's shape), randomly initialised, for GPU timing without weights.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_ms: float  # median over requests of (last token - first token) / (tokens - 1)


def workload(count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        Request([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(count)
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _result(requests: list[Request], started: float, first: list[float], last: list[float]) -> Result:
    seconds = max(last) - started
    tokens = sum(r.output_len for r in requests)
    per_token = [
        (lt - ft) / (r.output_len - 1) for r, ft, lt in zip(requests, first, last, strict=True) if r.output_len > 1
    ]
    ttft = [(f - started) * 1000 for f in first]
    return Result(
        requests=len(requests),
        output_tokens=tokens,
        seconds=round(seconds, 3),
        tokens_per_s=round(tokens / seconds, 1),
        ttft_p50_ms=round(_percentile(ttft, 0.5), 1),
        ttft_p99_ms=round(_percentile(ttft, 0.99), 1),
        tpot_ms=round(statistics.median(per_token) * 1000, 2),
    )


def _sync(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


def run_engine(loaded: LoadedModel, config: EngineConfig, requests: list[Request]) -> Result:
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine = Engine(loaded, config, lambda batch: events.put((time.perf_counter(), batch)))
    engine.start()
    try:
        _engine_pass(engine, events, requests[:2])  # warm up
        ids = [uuid.uuid4().hex for _ in requests]
        started = time.perf_counter()
        first, last = _engine_pass(engine, events, requests, ids)
    finally:
        engine.stop()
    return _result(requests, started, [first[i] for i in ids], [last[i] for i in ids])


def _engine_pass(engine: Engine, events: queue.SimpleQueue, requests: list[Request], ids: list[str] | None = None):
    ids = ids or [uuid.uuid4().hex for _ in requests]
    now = time.time()
    for request_id, request in zip(ids, requests, strict=True):
        sampling = SamplingParams(seed=1, max_new_tokens=request.output_len, ignore_eos=True)
        engine.submit(
            GenerationRequest(
                request_id=request_id,
                model="bench",
                prompt_token_ids=request.prompt,
                sampling=sampling,
                arrival=now,
                deadline=now + 3600,
                reply_to="bench",
            ),
            time.monotonic(),
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while len(last) < len(ids):
        at, batch = events.get()
        for event in batch:
            if event.error is not None:
                raise RuntimeError(event.error.message)
            first.setdefault(event.request_id, at)
            if event.finish_reason is not None:
                last[event.request_id] = at
    return first, last


class _StepClock(LogitsProcessor):
    """Records when `generate` draws each token: step i's time is token i's for the whole batch."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _sync(self.loaded)
        self.times.append(time.perf_counter())
        return scores


def _generate(loaded: LoadedModel, batch: list[Request], pad: int) -> list[float]:
    """Greedy `generate` of a left-padded batch for as long as its longest request; the time of each step."""
    length = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), length), pad, device=loaded.device)
    mask = torch.zeros((len(batch), length), dtype=torch.long, device=loaded.device)
    for row, request in enumerate(batch):
        ids[row, length - len(request.prompt) :] = torch.tensor(request.prompt, device=loaded.device)
        mask[row, length - len(request.prompt) :] = 1
    clock = _StepClock(loaded)
    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in batch), do_sample=False, eos_token_id=None, pad_token_id=pad
    )
    with torch.inference_mode():
        loaded.model.generate(
            ids, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([clock])
        )
    return clock.times


def run_static_batches(loaded: LoadedModel, requests: list[Request], batch_size: int) -> Result:
    pad = loaded.tokenizer.pad_token_id or 0
    _generate(loaded, requests[:2], pad)  # warm up
    started = time.perf_counter()
    first: list[float] = []
    last: list[float] = []
    for offset in range(0, len(requests), batch_size):
        batch = requests[offset : offset + batch_size]
        steps = _generate(loaded, batch, pad)
        first += [steps[0]] * len(batch)
        last += [steps[r.output_len - 1] for r in batch]  # later steps only pad this request out
    return _result(requests, started, first, last)


def run_one_at_a_time(loaded: LoadedModel, requests: list[Request]) -> Result:
    pad = loaded.tokenizer.pad_token_id or 0
    _generate(loaded, requests[:1], pad)  # warm up
    started = time.perf_counter()
    first: list[float] = []
    last: list[float] = []
    for request in requests:
        steps = _generate(loaded, [request], pad)
        first.append(steps[0])
        last.append(steps[-1])
    return _result(requests, started, first, last)


def run_transformers_continuous(loaded: LoadedModel, requests: list[Request]) -> Result:
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=loaded.tokenizer.pad_token_id or 0)
    with loaded.model.continuous_batching_context_manager(generation_config=config, warmup=False) as manager:
        for request in requests[:2]:  # warm up
            manager.add_request(input_ids=request.prompt, max_new_tokens=request.output_len, eos_token_id=-1)
        for _ in requests[:2]:
            _finished(manager)
        started = time.perf_counter()
        ids = [
            manager.add_request(
                input_ids=r.prompt, max_new_tokens=r.output_len, eos_token_id=-1, record_timestamps=True
            )
            for r in requests
        ]
        outputs = {}
        while len(outputs) < len(ids):
            output = _finished(manager)
            outputs[output.request_id] = output
    first = [outputs[i].timestamps[0] for i in ids]
    last = [outputs[i].timestamps[-1] for i in ids]
    return _result(requests, started, first, last)


def _finished(manager):
    while True:
        output = manager.get_result(timeout=600)
        if output is None:
            raise RuntimeError("transformers' continuous batching stopped answering")
        if output.is_finished():
            return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(BUNDLED_MODEL), help="model directory or hub id (default: bundled)")
    parser.add_argument(
        "--random-llama-1b",
        action="store_true",
        help="time a randomly initialised ~1.1 B Llama instead (no weights needed)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float64; default per device")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-lens", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--one-at-a-time", type=int, default=16, help="requests the one-at-a-time baseline runs")
    parser.add_argument(
        "--continuous-batching",
        type=int,
        default=128,
        help="requests transformers' continuous batching runs (it takes ~5 minutes for 256 on 2 CPUs)",
    )
    parser.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size)
    parser.add_argument("--max-tokens-per-step", type=int, default=EngineConfig.max_tokens_per_step)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs of the engine and of static batches (the closest baseline), interleaved; the best of each counts",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["one_at_a_time", "static_batches", "continuous"],
        help="baselines to leave out",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    if args.random_llama_1b:
        base = load_model(str(BUNDLED_MODEL), "cpu")
        config = LlamaConfig(vocab_size=base.vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=3, **LLAMA_1B)

        def fresh() -> LoadedModel:
            torch.manual_seed(0)
            return random_model(config, base.tokenizer, args.device, args.dtype)
    else:

        def fresh() -> LoadedModel:
            return load_model(args.model, args.device, args.dtype)

    engine_model = fresh()
    requests = workload(args.requests, args.prompt_lens, args.output_lens, engine_model.vocab_size, args.seed)
    engine_config = EngineConfig(
        max_batch_size=args.max_batch_size,
        max_tokens_per_step=args.max_tokens_per_step,
        max_seq_len=max(2560, args.prompt_lens[1] + args.output_lens[1]),
        max_iter_times=args.output_lens[1],
    )
    report: dict = {
        "workload": {
            "requests": args.requests,
            "prompt_lens": args.prompt_lens,
            "output_lens": args.output_lens,
            "seed": args.seed,
            "device": str(engine_model.device),
            "dtype": str(engine_model.model.dtype),
        }
    }
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout's last line is the JSON
    baseline_model = fresh()  # the engine sets its own attention on its model
    engine_runs: list[Result] = []
    static_runs: list[Result] = []
    for _ in range(args.repeat):  # interleaved, so that a noisy spell of a shared machine hits both alike
        engine_runs.append(run_engine(engine_model, engine_config, requests))
        if "static_batches" not in args.skip:
            static_runs.append(run_static_batches(baseline_model, requests, args.max_batch_size))
    engine = max(engine_runs, key=lambda r: r.tokens_per_s)
    _print("engine", engine, out)
    baselines: dict[str, Result] = {}
    if "one_at_a_time" not in args.skip:
        baselines["transformers_one_at_a_time"] = run_one_at_a_time(baseline_model, requests[: args.one_at_a_time])
    if static_runs:
        baselines["transformers_static_batches"] = max(static_runs, key=lambda r: r.tokens_per_s)
    if "continuous" not in args.skip:
        subset = requests[: args.continuous_batching]
        baselines["transformers_continuous_batching"] = run_transformers_continuous(baseline_model, subset)
    for name, result in baselines.items():
        _print(name, result, out)
    ratios = {name: round(engine.tokens_per_s / result.tokens_per_s, 2) for name, result in baselines.items()}
    for name, ratio in ratios.items():
        print(f"engine / {name}: {ratio}x tokens/s", file=out)
    if args.json:
        report.update(engine=asdict(engine), baselines={k: asdict(v) for k, v in baselines.items()}, ratios=ratios)
        print(json.dumps(report))


def _print(name: str, result: Result, out) -> None:
    print(
        f"{name:34s} {result.tokens_per_s:9.1f} tok/s  TTFT p50 {result.ttft_p50_ms:9.1f} ms  "
        f"p99 {result.ttft_p99_ms:9.1f} ms  TPOT {result.tpot_ms:7.2f} ms  "
        f"({result.requests} requests, {result.output_tokens} tokens, {result.seconds} s)",
        file=out,
        flush=True,
    )
