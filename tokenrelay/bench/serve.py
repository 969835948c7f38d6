"""`tokenrelay bench serve`: load on a streaming endpoint, measured as a client sees it.

In the manner of vLLM's benchmark_serving: a seeded workload (prompts of
random token ids decoded to text, output lengths drawn per request, greedy
with a fixed seed so every run asks for the same tokens), sent at a fixed
concurrency or with Poisson arrivals at a rate, to generate_stream (SSE),
/infer (MindIE's native stream) or /ws (WebSocket). Reported: time to first
token, time per output token, inter-token latency and end-to-end latency at
p50/p90/p99, request and output token throughput; and beside them, under
"aisbench", AISBench's metrics by its own names and definitions
(tokenrelay/bench/aisbench.py), which a MindIE user compares.

Against a running server (`--url`), or against topologies it starts itself
side by side and loads in turn, `--rounds` times (`--topology serve kafka`:
`tokenrelay serve`, and a gateway and a worker on Kafka, on
`--kafka-bootstrap` or on a local broker from deploy/kafka/), in which case it
also prints the Kafka topology's token throughput over the in-process one and
the latency the Kafka hop adds.
`--json` prints everything as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tqdm import tqdm

from tokenrelay.bench import aisbench, plots
from tokenrelay.bench.help import HelpFormatter, add_length_range
from tokenrelay.bench.load import ENDPOINTS, Outcome, Request, load_client, one_stream, summarize
from tokenrelay.topology import free_port, local_broker, tokenrelay_processes, wait_ready
from workers.bundled import BUNDLED_MODEL


def workload(count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int) -> list[Request]:
    """Prompts of random token ids of the bundled tokenizer, as text; output lengths drawn per request."""
    from transformers import AutoTokenizer  # here, not above: transformers takes seconds to import

    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    prompts = [
        (tokenizer.decode([rng.choice(ids) for _ in range(rng.randint(*prompt_lens))]), rng.randint(*output_lens))
        for _ in range(count)
    ]
    return [  # the prompt's tokens counted as AISBench counts them: the tokenizer's encoding, special tokens and all
        Request(prompt=prompt, max_new_tokens=new, prompt_tokens=len(tokenizer.encode(prompt)))
        for prompt, new in prompts
    ]


def results_of(outcomes: list[Outcome], seconds: float, span_s: float, concurrency: int) -> dict:
    """Our figures of a load that took `seconds`, and AISBench's (tokenrelay/bench/aisbench.py) under "aisbench",
    its Benchmark Duration `span_s`."""
    return {**summarize(outcomes, seconds), "aisbench": aisbench.metrics(outcomes, span_s, concurrency)}


async def run_load(
    base: str,
    model: str,
    endpoint: str,
    requests: list[Request],
    concurrency: int,
    rate: float,
    seed: int,
    progress: str = "",
) -> dict:
    """Send the workload (as send_load does); the measured figures."""
    outcomes, seconds = await send_load(base, model, endpoint, requests, concurrency, rate, seed, progress)
    return results_of(outcomes, seconds, aisbench.span(outcomes), concurrency)


async def send_load(
    base: str,
    model: str,
    endpoint: str,
    requests: list[Request],
    concurrency: int,
    rate: float,
    seed: int,
    progress: str = "",
) -> tuple[list[Outcome], float]:
    """Send the workload; each request's outcome, and the seconds it all took. `progress`: the label of a
    progress bar of finished requests on stderr (none when empty, or when stderr is not a terminal)."""
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    client = load_client()
    bar = tqdm(total=len(requests), desc=progress, unit="req", disable=None if progress else True, leave=False)

    async def limited(request: Request) -> Outcome:
        async with limit:
            outcome = await one_stream(endpoint, client, base, model, request)
        bar.update()
        return outcome

    started = time.perf_counter()
    tasks = []
    try:
        for request in requests:
            tasks.append(asyncio.create_task(limited(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
    finally:
        bar.close()
        await client.aclose()
    return outcomes, time.perf_counter() - started


# -- topologies started here


@contextmanager
def topology(name: str, logs: Path, worker_args: list[str], kafka_bootstrap: str, model: str) -> Iterator[str]:
    """A `tokenrelay serve`, or a gateway and a worker on Kafka; yields the gateway's base URL once ready."""
    port = free_port()
    names = ["--served-model-name", model]
    if name == "serve":
        commands = [["serve", "--port", str(port), *names, *worker_args]]
    else:
        kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", f"bench{uuid.uuid4().hex[:8]}"]
        commands = [["worker", *kafka, *names, *worker_args], ["gateway", "--port", str(port), *kafka]]
    with tokenrelay_processes(commands, logs) as processes:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, model, processes)
        yield base


def compare(results: dict[str, dict], topology: str, reference: str) -> dict:
    """One topology against another (the Kafka one against serve, serve against the engine alone): the token
    throughput ratio, and the latency it adds."""
    measured, base = results[topology], results[reference]
    return {
        f"{topology}_over_{reference}_token_throughput": round(
            measured["output_token_throughput"] / max(base["output_token_throughput"], 1e-9), 3
        ),
        f"{topology}_added_latency_ms": {
            f"{metric}_{q}": round(measured[f"{metric}_ms"][q] - base[f"{metric}_ms"][q], 2)
            for metric in ("ttft", "itl")
            for q in ("p50", "p99")
        },
    }


def _print_table(name: str, result: dict) -> None:
    line = (
        f"{name:8s} {result['output_token_throughput']:8.1f} tok/s  {result['request_throughput']:6.2f} req/s  "
        f"done {result['completed']}/{result['requests']}  "
    )
    for metric in ("ttft", "tpot", "itl", "e2e"):
        figures = result[f"{metric}_ms"]
        line += f"{metric.upper()} p50/p90/p99 {figures['p50']:.1f}/{figures['p90']:.1f}/{figures['p99']:.1f} ms  "
    print(line.rstrip(), flush=True)
    print(aisbench.line(name, result["aisbench"]), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenrelay bench serve", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:1025")
    parser.add_argument(
        "--topology",
        nargs="+",
        choices=["engine", "serve", "kafka"],
        help="start these here, one at a time (engine: the same requests straight to an engine in this process)",
    )
    parser.add_argument("--kafka-bootstrap", default="", help="for --topology kafka; empty: a local broker")
    parser.add_argument("--worker-args", default="", help="extra flags for the worker (or serve), one string")
    parser.add_argument("--model", default="tokenrelay-tiny", help="the model name to request")
    parser.add_argument(
        "--endpoint", choices=ENDPOINTS, default="generate_stream", help="the streaming endpoint loaded"
    )
    parser.add_argument("--requests", type=int, default=256, help="requests of the workload")
    parser.add_argument("--concurrency", type=int, default=64, help="streams open at once at most")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    add_length_range(parser, "prompt-lens", (32, 512), "prompt tokens, drawn per request")
    add_length_range(parser, "output-lens", (16, 256), "new tokens, drawn per request")
    parser.add_argument(
        "--seed", type=int, default=0, help="of the workload and the arrivals: the same seed, the same load"
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --topology: each sends the workload once, in turn")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    parser.add_argument(
        "--plot",
        default="",
        help="write a PNG of tokens/s, TTFT and ITL per topology: this .png file, or serve.png in this directory",
    )
    args = parser.parse_args(argv)
    if bool(args.url) == bool(args.topology):
        parser.error("give either --url or --topology")

    requests = workload(args.requests, tuple(args.prompt_lens), tuple(args.output_lens), args.seed)
    load = dict(
        model=args.model,
        endpoint=args.endpoint,
        requests=requests,
        concurrency=args.concurrency,
        rate=args.request_rate,
        seed=args.seed,
    )
    results: dict[str, dict] = {}
    if args.url:
        results["server"] = asyncio.run(run_load(args.url, **load, progress="server"))
        _print_table("server", results["server"])
    else:
        with tempfile.TemporaryDirectory(prefix="tokenrelay-bench-") as scratch, ExitStack() as running:
            logs = Path(scratch)
            bootstrap = running.enter_context(_bootstrap(args, logs))
            worker_args = args.worker_args.split()
            bases = {
                name: running.enter_context(topology(name, logs, worker_args, bootstrap, args.model))
                for name in dict.fromkeys(args.topology)
                if name != "engine"
            }
            for base in bases.values():
                asyncio.run(run_load(base, **{**load, "requests": requests[:4]}))  # warm up
            direct = {key: load[key] for key in ("requests", "concurrency", "rate", "seed")}
            if "engine" in args.topology:
                from tokenrelay.bench.serve_engine import EngineTopology

                engine = EngineTopology(worker_args)
                running.callback(engine.close)
                engine.send_load(**{**direct, "requests": requests[:4]})  # warm up
                bases = {"engine": "", **bases}
            sent: dict[str, tuple[list[Outcome], float, float]] = {name: ([], 0.0, 0.0) for name in bases}
            # Taking turns, round after round: a machine that slows down or speeds up meanwhile
            # (a shared one does) weighs on every topology alike.
            for round_ in range(1, args.rounds + 1):
                for name, base in bases.items():
                    label = f"{name} round {round_}/{args.rounds}"
                    if name == "engine":
                        outcomes, seconds = engine.send_load(**direct)
                    else:
                        outcomes, seconds = asyncio.run(send_load(base, **load, progress=label))
                    so_far, took, spans = sent[name]  # AISBench's duration: each round's, as if back to back
                    sent[name] = (so_far + outcomes, took + seconds, spans + aisbench.span(outcomes))
            for name, (outcomes, seconds, span_s) in sent.items():
                results[name] = results_of(outcomes, seconds, span_s, args.concurrency)
                _print_table(name, results[name])
    report = {
        "workload": {key: value for key, value in vars(args).items() if key not in ("json", "url", "plot")},
        "results": results,
    }
    report["comparison"] = {}
    for measured, reference in (("serve", "engine"), ("kafka", "serve")):
        if {measured, reference} <= results.keys():
            comparison = compare(results, measured, reference)
            report["comparison"].update(comparison)
            added = comparison[f"{measured}_added_latency_ms"]
            print(
                f"{measured} / {reference} token throughput: "
                f"{comparison[f'{measured}_over_{reference}_token_throughput']}x; "
                f"{measured} adds TTFT p50 {added['ttft_p50']} ms, p99 {added['ttft_p99']} ms; "
                f"ITL p50 {added['itl_p50']} ms, p99 {added['itl_p99']} ms",
                flush=True,
            )
    if args.plot:
        print(f"plot written to {plots.serve(results, plots.target(args.plot, 'serve'))}", flush=True)
    if args.json:
        print(json.dumps(report), flush=True)


@contextmanager
def _bootstrap(args: argparse.Namespace, logs: Path) -> Iterator[str]:
    if "kafka" not in args.topology or args.kafka_bootstrap:
        yield args.kafka_bootstrap
        return
    with local_broker(logs / "kafka") as bootstrap:
        yield bootstrap
