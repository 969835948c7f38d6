"""`tokenrelay bench engine --speculative ngram|draft`: the engine with speculative decoding against without.

Two workloads, greedy with EOS ignored (so both runs generate the same
tokens), each at every `--concurrency` (the engine's batch size), with and
without speculation, interleaved, the best of `--repeat` runs each:
- copy-heavy: prompts whose answers repeat long spans of the prompt, as code
  editing and quoting do. The bundled 4-layer model cannot copy a passage it
  has not itself written (given a 100-token random passage twice and its
  start a third time, it continues none of it), so its copy-heavy prompts are
  its own text: a seed sentence and the model's greedy continuation of it
  (`--copy-prompt-len` tokens), whose answer goes on repeating that text's
  spans. A model that copies (any real one) takes real documents instead;
- default: the bench's own seeded workload (random prompt token ids of
  `--prompt-lens`, outputs of `--output-lens`), the first requests of it.
Each line gives TPOT (the median over requests of the time per output token
after the first), tokens/s, the share of proposed tokens accepted and the
mean accepted per verification; each pair, TPOT without over TPOT with.
Last, tokens/s on the whole default workload (`--requests`) at the engine's
own batch size, with speculation left on (its switch-off rule at work)
against off.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from tokenrelay.bench.engine_runs import Request, Result, generate, run_engine, workload

# Seeds of the copy-heavy prompts: openings of the kind of prose the bundled model was trained on.
SEEDS = (
    "The following example",
    "A context manager is",
    "Return the number of",
    "def main():\n",
    "The os module provides",
    "If the value is",
    "This function returns",
    "An iterator is",
    "The default argument",
    "Raise an exception if",
    "A class may define",
    "The module defines",
    "When the file is",
    "Each item of the list",
    "The optional argument",
    "Note that the",
)
COPY_OUTPUT_LEN = 128
SINGLE_REQUESTS = 4  # at concurrency 1: each of these runs alone


def compare(loaded, args: argparse.Namespace) -> dict:
    """Run the comparison and print it (with --json, the report as stdout's last line)."""
    from workers.engine.config import EngineConfig

    out = sys.stderr if args.json else sys.stdout
    config = EngineConfig(
        max_seq_len=max(2560, args.prompt_lens[1] + args.output_lens[1], args.copy_prompt_len + COPY_OUTPUT_LEN + 64),
        max_iter_times=max(args.output_lens[1], COPY_OUTPUT_LEN),
        cuda_graphs=not args.no_cuda_graphs,
    )
    speculating = replace(
        config,
        speculative=args.speculative,
        speculative_model=args.speculative_model if args.speculative == "draft" else None,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_always=args.speculative_always,
    )
    most = max(args.concurrency) * 4
    workloads = {
        "copy-heavy": copy_heavy(loaded, config, args.copy_prompt_len, most),
        "default": workload(most, args.prompt_lens, args.output_lens, loaded.vocab_size, args.seed),
    }
    print(
        f"{'workload':12s} {'concurrency':>11s} {'speculation':>11s} {'TPOT ms':>9s} {'tok/s':>9s} "
        f"{'accepted':>9s} {'per verif.':>10s}",
        file=out,
        flush=True,
    )
    rows = []
    for name, requests in workloads.items():
        for concurrency in args.concurrency:
            chosen = requests[: SINGLE_REQUESTS if concurrency == 1 else concurrency * 4]
            pair = {}
            for label, engine_config in (("off", config), (args.speculative, speculating)):
                engine_config = replace(engine_config, max_batch_size=concurrency)
                runs = [run_engine(loaded, engine_config, chosen) for _ in range(args.repeat)]
                pair[label] = min(runs, key=lambda r: r.tpot_ms)
                _line(name, concurrency, label, pair[label], out)
            ratio = round(pair["off"].tpot_ms / pair[args.speculative].tpot_ms, 2)
            print(f"  TPOT {ratio}x lower with {args.speculative}", file=out, flush=True)
            rows.append(
                {
                    "workload": name,
                    "concurrency": concurrency,
                    "requests": len(chosen),
                    "off": asdict(pair["off"]),
                    "speculative": asdict(pair[args.speculative]),
                    "tpot_ratio": ratio,
                }
            )
    whole = workload(args.requests, args.prompt_lens, args.output_lens, loaded.vocab_size, args.seed)
    throughput: dict[str, Result] = {}
    for _ in range(args.repeat):  # interleaved: a noisy spell of a shared machine hits both alike
        for label, engine_config in (("off", config), (args.speculative, speculating)):
            result = run_engine(loaded, engine_config, whole)
            if label not in throughput or result.tokens_per_s > throughput[label].tokens_per_s:
                throughput[label] = result
    ratio = round(throughput[args.speculative].tokens_per_s / throughput["off"].tokens_per_s, 3)
    batch = config.for_device(loaded.device.type).max_batch_size
    print(
        f"default workload, {args.requests} requests at batch {batch}: {throughput['off'].tokens_per_s} tok/s off, "
        f"{throughput[args.speculative].tokens_per_s} tok/s {args.speculative}: {ratio}x"
        + _acceptance(throughput[args.speculative]),
        file=out,
        flush=True,
    )
    report = {
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_always": args.speculative_always,
        "device": str(loaded.device),
        "dtype": str(loaded.model.dtype),
        "rows": rows,
        "throughput": {label: asdict(result) for label, result in throughput.items()},
        "throughput_ratio": ratio,
    }
    if args.json:
        print(json.dumps(report))
    return report


def copy_heavy(loaded, config, prompt_len: int, count: int) -> list[Request]:
    """Up to `count` seeds (16 at most), each with the model's own greedy continuation of it, `prompt_len`
    tokens, as a prompt."""
    seeds = [Request(loaded.tokenizer(seed)["input_ids"], prompt_len) for seed in SEEDS[:count]]
    continuations = generate(loaded, config, seeds)
    return [Request(seed.prompt + text, COPY_OUTPUT_LEN) for seed, text in zip(seeds, continuations, strict=True)]


def _acceptance(result: Result) -> str:
    counts = result.speculation
    if not counts or not counts["proposed"]:
        return ""
    share = counts["accepted"] / counts["proposed"]
    return f" ({share:.0%} of {counts['proposed']} proposed tokens accepted)"


def _line(name: str, concurrency: int, label: str, result: Result, out) -> None:
    counts = result.speculation
    accepted = per_verification = ""
    if counts and counts["proposed"]:
        accepted = f"{counts['accepted'] / counts['proposed']:.0%}"
        per_verification = f"{counts['accepted'] / counts['verifications']:.2f}"
    print(
        f"{name:12s} {concurrency:11d} {label:>11s} {result.tpot_ms:9.2f} {result.tokens_per_s:9.1f} "
        f"{accepted:>9s} {per_verification:>10s}",
        file=out,
        flush=True,
    )
