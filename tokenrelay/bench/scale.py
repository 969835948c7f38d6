"""`tokenrelay bench scale`: a fleet of simulated workers behind several gateways on one Kafka, grown step by step.

For each worker count N (`--workers 1 2 3 ...`) it starts a local broker's
topics anew, `tokenrelay simulate --workers N` (the real worker and engine
around a step-time profile, workers/simulated/) and `--gateways` gateways,
then drives a saturating seeded load: 1.5 streams per batch slot of the
fleet, each sending request after request to generate_stream, round robin
over the gateways. It prints per N: token throughput, scaling efficiency
(throughput / (N x the throughput at N=1)), TTFT p50/p99, the share of
worker-seconds spent idle while a request waited elsewhere, the prefix
cache's hit rate, and each gateway's streamed tokens/s and CPU use.

Then a multi-turn chat load (`--conversations`, each turn resending the
history after a shared system prompt) on `--chat-workers` workers, placed by
the router, placed by the shared request topics alone (gateways with
`--no-router`, the placement before the router), and on one worker with the
same total cache and batch: prefix-cache hit rate and TTFT of each.

With `--adapters K`, a load of K LoRA adapters (a request's adapter drawn
uniformly) on `--adapter-workers` workers of `--max-loras` device slots
each, placed by the router (which prices loading an adapter) and by the
shared request topics (adapter-blind): adapter loads per 1,000 requests and
TTFT of each. An adapter's load takes the profile's `adapter_load_s`.

The profile's step times are multiplied by `--slowdown` (the chat's by
`--chat-slowdown`, the adapters' by `--adapter-slowdown`: less, so that
their window holds some 300 requests, long after the first loads) so that the fleet's tokens fit through one machine's
broker, gateways and clients (here: about 1,300 tokens/s in all, streamed);
efficiency is a ratio, and a uniform slowdown leaves it as it is. The CPU
cores each process used are printed, to tell a dispatch limit from the
machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bus.topics import routing_topic
from tokenrelay.bench import plots
from tokenrelay.bench.help import HelpFormatter, add_length_range
from tokenrelay.bench.load import Outcome, Request, load_client, one_stream, percentiles, sse
from tokenrelay.topology import bench_site, free_port, tokenrelay_processes, wait_ready
from workers.simulated.profile import Profile, StepCost

# The Kafka client and the messages' schemas are imported where they are used, so that `--help` answers at once.
if TYPE_CHECKING:
    from bus.kafka import KafkaBus
    from schemas.messages import WorkerLoad

MODEL = "sim"
_WORDS = [f"{a}{b}{c}" for a in "bcdfgklmnprst" for b in "aeiou" for c in "lmnrst"]
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_HELD = "tokenrelay_gateway_requests_held{"


def _text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(_WORDS))
    return " ".join(words)


class FleetWatch:
    """The workers' load reports, from the routing topic, and the gateways' held requests, from their metrics:
    who is up, idleness while requests wait, cache totals."""

    def __init__(self, gateways: list[str]) -> None:
        self._gateways = gateways
        self.held = dict.fromkeys(gateways, 0)  # requests waiting in each gateway for a worker with room
        self.loads: dict[str, WorkerLoad] = {}
        self.measuring = False
        self.idle_s = 0.0  # worker-seconds idle while a request waited for another worker
        self.worker_s = 0.0

    async def follow(self, bus: KafkaBus, topic: str) -> None:
        from schemas.messages import WorkerLoad

        listener = await bus.listen(topic, replay_s=5.0)
        try:
            async for message in listener:
                if isinstance(message, WorkerLoad):
                    self.loads[message.worker_id] = message
        finally:
            await listener.close()

    async def poll_gateways(self, period_s: float = 0.05) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                for base in self._gateways:
                    text = (await client.get(f"{base}/metrics")).text
                    self.held[base] = sum(
                        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(_HELD)
                    )
                await asyncio.sleep(period_s)

    async def sample(self, period_s: float = 0.01) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(period_s)
            now = time.perf_counter()
            if self.measuring:
                loads = list(self.loads.values())
                free = sum(1 for load in loads if load.running < load.capacity)
                waiting = sum(load.waiting for load in loads) + sum(self.held.values())
                self.idle_s += min(free, waiting) * (now - last)
                self.worker_s += len(loads) * (now - last)
            last = now

    def adapter_loads(self) -> int:
        """Adapters put into device slots, summed over the workers (since they started)."""
        return sum(load.adapter_loads for load in self.loads.values())

    def cache_totals(self) -> tuple[int, int]:
        """Prompt tokens started, and those found cached, summed over the workers (since they started)."""
        loads = self.loads.values()
        return sum(load.prompt_tokens for load in loads), sum(load.cached_prompt_tokens for load in loads)


def _rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) // 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


@contextmanager
def fleet(
    args: argparse.Namespace,
    bootstrap: str,
    profile_path: Path,
    logs: Path,
    workers: int,
    batch: int,
    route: bool,
    worker_args: tuple[str, ...] = (),
) -> Iterator[tuple[list[str], list[int], str]]:
    """N simulated workers (with `worker_args` too) and the gateways on fresh topics, once ready: the gateways'
    base URLs, the pids (the simulating process's first) and the topic prefix."""
    kafka = [
        "--kafka-bootstrap",
        bootstrap,
        "--topic-prefix",
        f"scale{uuid.uuid4().hex[:8]}",
        "--log-level",
        args.log_level,
    ]
    ports = [free_port() for _ in range(args.gateways)]
    simulate = ["simulate", "--workers", str(workers), "--simulate", str(profile_path), "--worker-id", "sim"]
    commands = [[*simulate, "--served-model-name", MODEL, "--max-batch-size", str(batch), *kafka, *worker_args]]
    commands += [["gateway", "--port", str(p), *kafka, *([] if route else ["--no-router"])] for p in ports]
    with tokenrelay_processes(commands, logs) as processes:
        bases = [f"http://127.0.0.1:{p}" for p in ports]
        for base in bases:
            wait_ready(base, MODEL, processes)
        yield bases, [p.pid for p in processes], kafka[3]


async def _watching(bootstrap: str, prefix: str, bases: list[str], workers: int):
    from bus.factory import open_bus
    from bus.settings import KafkaSettings

    bus = open_bus(KafkaSettings(bootstrap_servers=bootstrap), client_id="bench-scale")
    await bus.start()
    watch = FleetWatch(bases)
    tasks = [
        asyncio.create_task(watch.follow(bus, routing_topic(prefix))),
        asyncio.create_task(watch.sample()),
        asyncio.create_task(watch.poll_gateways()),
    ]
    deadline = time.monotonic() + 120
    while len(watch.loads) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(watch.loads)} of {workers} workers reported within 120 s")
        await asyncio.sleep(0.1)
    return bus, watch, tasks


async def _stop(bus: KafkaBus, tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.close()


async def saturate(args: argparse.Namespace, bootstrap: str, prefix: str, bases: list[str], pids, workers: int):
    """The saturating load on a ready fleet: its figures over the measured window."""
    bus, watch, tasks = await _watching(bootstrap, prefix, bases, workers)
    rng = random.Random(args.seed)
    streams = math.ceil(1.5 * workers * args.max_batch_size)
    client = load_client()
    outcomes: list[tuple[int, Outcome]] = []  # (gateway, outcome)
    started = time.perf_counter()
    window = (started + args.warmup, started + args.warmup + args.duration)

    async def stream(index: int) -> None:
        own = random.Random(rng.random())
        gateway = index % len(bases)
        while time.perf_counter() < window[1]:
            request = Request(_text(own, args.prompt_bytes), own.randint(*args.output_lens))
            outcomes.append((gateway, await one_stream("generate_stream", client, bases[gateway], MODEL, request)))

    clients = [asyncio.create_task(stream(i)) for i in range(streams)]
    await asyncio.sleep(args.warmup)
    cpu_before = [_cpu_seconds(pid) for pid in pids]
    own_before = time.process_time()
    prompt_before = watch.cache_totals()
    watch.measuring = True
    await asyncio.sleep(args.duration)
    watch.measuring = False
    cores = [(_cpu_seconds(pid) - before) / args.duration for pid, before in zip(pids, cpu_before, strict=True)]
    client_cores = (time.process_time() - own_before) / args.duration
    workers_rss = _rss_mib(pids[0])
    prompt_after = watch.cache_totals()
    await asyncio.gather(*clients)
    await client.aclose()
    await _stop(bus, tasks)
    in_window = [(g, o) for g, o in outcomes if window[0] <= o.sent_at < window[1] and o.token_times]
    tokens_by_gateway = [0] * len(bases)
    for gateway, outcome in outcomes:
        tokens_by_gateway[gateway] += sum(1 for t in outcome.token_times if window[0] <= t < window[1])
    prompt, cached = (after - before for after, before in zip(prompt_after, prompt_before, strict=True))
    ttft = percentiles([o.token_times[0] - o.sent_at for _, o in in_window])
    return {
        "workers": workers,
        "streams": streams,
        "token_throughput": round(sum(tokens_by_gateway) / args.duration, 1),
        "ttft_ms": ttft,
        "failed": sum(1 for _, o in outcomes if o.error is not None),
        "errors": sorted({o.error for _, o in outcomes if o.error})[:3],
        "idle_while_waiting": round(watch.idle_s / max(watch.worker_s, 1e-9), 4),
        "prefix_hit_rate": round(cached / max(prompt, 1), 3),
        "gateway_tokens_per_s": [round(t / args.duration, 1) for t in tokens_by_gateway],
        # Cores busy: where the machine's time goes.
        "gateway_cores": [round(c, 2) for c in cores[1:]],
        "simulated_workers_cores": round(cores[0], 2),
        "client_cores": round(client_cores, 2),
        "simulated_workers_rss_mib": workers_rss,
    }


async def place_adapters(args: argparse.Namespace, bootstrap: str, prefix: str, bases: list[str], names: list[str]):
    """The saturating load with each request under a random one of the adapters `names`: loads and TTFT."""
    workers = args.adapter_workers
    bus, watch, tasks = await _watching(bootstrap, prefix, bases, workers)
    rng = random.Random(args.seed)
    client = load_client()
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    window = (started + args.warmup, started + args.warmup + args.duration)

    async def stream(index: int) -> None:
        own = random.Random(rng.random())
        while time.perf_counter() < window[1]:
            request = Request(_text(own, args.prompt_bytes), own.randint(*args.output_lens))
            base = bases[index % len(bases)]
            outcomes.append(await one_stream("generate_stream", client, base, own.choice(names), request))

    clients = [asyncio.create_task(stream(i)) for i in range(math.ceil(1.5 * workers * args.max_batch_size))]
    await asyncio.sleep(args.warmup)
    loads_before = watch.adapter_loads()
    await asyncio.sleep(args.duration)
    await asyncio.sleep(0.3)  # the window's last reports
    loads = watch.adapter_loads() - loads_before
    await asyncio.gather(*clients)
    await client.aclose()
    await _stop(bus, tasks)
    in_window = [o for o in outcomes if window[0] <= o.sent_at < window[1] and o.token_times]
    return {
        "requests": len(in_window),
        "adapter_loads": loads,
        "loads_per_1000_requests": round(1000 * loads / max(len(in_window), 1), 1),
        "ttft_ms": percentiles([o.token_times[0] - o.sent_at for o in in_window]),
        "failed": sum(1 for o in outcomes if o.error is not None),
    }


def _adapters(args: argparse.Namespace, bootstrap: str, profile: Profile, logs: Path) -> dict:
    """The adapter load placed by the router and by the shared topics (see the module's docstring)."""
    import numpy as np
    from safetensors.numpy import save_file

    adapter = logs / "adapter"  # simulated workers read only an adapter's config and header: one tiny adapter
    adapter.mkdir(exist_ok=True)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_A.weight": np.zeros((8, 16), np.float32),
        f"{prefix}.lora_B.weight": np.zeros((16, 8), np.float32),
    }
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    names = [f"lora{i}" for i in range(args.adapters)]
    lora = ["--lora", *(f"{name}={adapter}" for name in names), "--max-loras", str(args.max_loras)]
    path = _slowed(profile, args.adapter_slowdown, args.kv_tokens, logs / "adapters.json")
    results = {}
    for name, route in (("router", True), ("shared_queue", False)):
        workers = args.adapter_workers
        with fleet(args, bootstrap, path, logs, workers, args.max_batch_size, route, tuple(lora)) as (bases, _, p):
            results[name] = asyncio.run(place_adapters(args, bootstrap, p, bases, names))
        result = results[name]
        print(
            f"adapters, {name:12s} ({args.adapters} adapters, {workers} workers of {args.max_loras} slots): "
            f"{result['loads_per_1000_requests']} loads per 1,000 requests  "
            f"TTFT p50/p99 {result['ttft_ms']['p50']:.0f}/{result['ttft_ms']['p99']:.0f} ms  "
            f"({result['requests']} requests, failed {result['failed']})",
            flush=True,
        )
    router, shared = (results[k]["loads_per_1000_requests"] for k in ("router", "shared_queue"))
    results["shared_queue_loads_over_router"] = round(shared / max(router, 1e-9), 2)
    print(f"adapters: the shared queue loads {results['shared_queue_loads_over_router']}x as often", flush=True)
    return results


async def _chat_turn(client: httpx.AsyncClient, base: str, messages: list[dict], seed: int, max_tokens: int):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "seed": seed, "stream": True}
    sent, first, text = time.perf_counter(), None, []
    async for chunk in sse(client, f"{base}/v1/chat/completions", body, "data: "):
        if not chunk.get("choices"):
            continue
        piece = chunk["choices"][0].get("delta", {}).get("content")
        if piece:
            first = first or time.perf_counter()
            text.append(piece)
    return (first or time.perf_counter()) - sent, "".join(text)


async def converse(args: argparse.Namespace, bootstrap: str, prefix: str, bases: list[str], workers: int) -> dict:
    """The multi-turn chat load on a ready fleet: prefix-cache hit rate and TTFT."""
    bus, watch, tasks = await _watching(bootstrap, prefix, bases, workers)
    rng = random.Random(args.seed)
    system = _text(rng, args.system_bytes)
    client = load_client()
    ttfts: list[float] = []

    async def conversation(index: int) -> None:
        own = random.Random(rng.random())
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": _text(own, args.user_bytes)})
            ttft, reply = await _chat_turn(client, bases[index % len(bases)], messages, index * 100 + turn, 32)
            ttfts.append(ttft)
            messages.append({"role": "assistant", "content": reply})

    before = watch.cache_totals()
    started = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    elapsed = time.perf_counter() - started
    await asyncio.sleep(0.3)  # the last reports
    prompt, cached = (after - b for after, b in zip(watch.cache_totals(), before, strict=True))
    await client.aclose()
    await _stop(bus, tasks)
    return {
        "workers": workers,
        "turns": len(ttfts),
        "prefix_hit_rate": round(cached / max(prompt, 1), 3),
        "ttft_ms": percentiles(ttfts),
        "seconds": round(elapsed, 1),
    }


def _print_scale(row: dict) -> None:
    ttft = row["ttft_ms"]
    print(
        f"N={row['workers']:3d}  {row['token_throughput']:8.1f} tok/s  efficiency {row['efficiency']:5.2f}  "
        f"TTFT p50/p99 {ttft['p50']:.0f}/{ttft['p99']:.0f} ms  idle-while-waiting {row['idle_while_waiting']:.2%}  "
        f"prefix hits {row['prefix_hit_rate']:.1%}  failed {row['failed']}  "
        f"gateways tok/s {row['gateway_tokens_per_s']}  cores: gateways {row['gateway_cores']} "
        f"workers {row['simulated_workers_cores']} clients {row['client_cores']}  "
        f"workers' RSS {row['simulated_workers_rss_mib']} MiB",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenrelay bench scale", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 32, 64], help="the worker counts, in turn"
    )
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes")
    parser.add_argument("--profile", default="bundled-cpu", help="a simulation profile: a name or a JSON file")
    parser.add_argument("--slowdown", type=float, default=60.0, help="multiplies the profile's step times")
    parser.add_argument("--chat-slowdown", type=float, default=10.0, help="the same, for the chat load")
    parser.add_argument("--max-batch-size", type=int, default=4, help="of every simulated worker")
    parser.add_argument("--kv-tokens", type=int, default=12288, help="KV cache of every simulated worker, in tokens")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured per worker count")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    parser.add_argument("--prompt-bytes", type=int, default=400, help="of each prompt of the load")
    add_length_range(parser, "output-lens", (16, 48), "new tokens, drawn per request")
    parser.add_argument("--chat-workers", type=int, default=8, help="0: no chat load")
    parser.add_argument("--conversations", type=int, default=64, help="of the chat load")
    parser.add_argument("--turns", type=int, default=6, help="of each conversation")
    parser.add_argument("--system-bytes", type=int, default=600, help="the system prompt every conversation shares")
    parser.add_argument("--user-bytes", type=int, default=500, help="of each user turn")
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters of the adapter load; 0: none")
    parser.add_argument("--adapter-workers", type=int, default=8, help="workers of the adapter load")
    parser.add_argument("--max-loras", type=int, default=4, help="device slots of each worker of the adapter load")
    parser.add_argument("--adapter-slowdown", type=float, default=15.0, help="the same, for the adapter load")
    parser.add_argument("--seed", type=int, default=0, help="of the loads' prompts and lengths")
    parser.add_argument("--kafka-bootstrap", default="", help="empty: a local broker from deploy/kafka/")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    parser.add_argument(
        "--plot",
        default="",
        help="write a PNG of throughput and TTFT against N: this .png file, or scale.png in this directory",
    )
    parser.add_argument("--log-level", default="warning", help="of the processes started")
    parser.add_argument("--log-dir", default="", help="keep the processes' logs here; empty: a temporary directory")
    args = parser.parse_args(argv)

    base = Profile.load(args.profile)
    shown = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "log_dir")}
    report: dict = {"settings": shown, "scale": []}
    with bench_site("tokenrelay-scale-", args.log_dir, args.kafka_bootstrap) as (logs, bootstrap):
        profile_path = _slowed(base, args.slowdown, args.kv_tokens, logs / "profile.json")
        print(f"profile {base.name} x{args.slowdown} slower, batch {args.max_batch_size}, {args.gateways} gateways")
        for workers in args.workers:
            with fleet(args, bootstrap, profile_path, logs, workers, args.max_batch_size, True) as (bases, pids, p):
                row = asyncio.run(saturate(args, bootstrap, p, bases, pids, workers))
            single = report["scale"][0] if report["scale"] else row
            row["efficiency"] = round(
                row["token_throughput"] / (workers * single["token_throughput"] / single["workers"]), 3
            )
            report["scale"].append(row)
            _print_scale(row)
        if args.chat_workers:
            report["chat"] = _chat(args, bootstrap, base, logs)
        if args.adapters:
            report["adapters"] = _adapters(args, bootstrap, base, logs)
    if args.plot:
        print(f"plot written to {plots.scale(report['scale'], plots.target(args.plot, 'scale'))}")
    if args.json:
        print(json.dumps(report), flush=True)


def _slowed(profile: Profile, slowdown: float, kv_tokens: int, path: Path) -> Path:
    """`profile` with its step times multiplied and its cache set, written to `path`."""
    slowed = {k: v * slowdown for k, v in dataclasses.asdict(profile.step).items()}
    adapter_load_s = profile.adapter_load_s * slowdown
    dataclasses.replace(
        profile, step=StepCost(**slowed), kv_cache_tokens=kv_tokens, adapter_load_s=adapter_load_s
    ).dump(path)
    return path


def _chat(args: argparse.Namespace, bootstrap: str, profile: Profile, logs: Path) -> dict:
    n = args.chat_workers
    each_path = _slowed(profile, args.chat_slowdown, args.kv_tokens, logs / "chat.json")
    merged_path = _slowed(profile, args.chat_slowdown, args.kv_tokens * n, logs / "one-big-worker.json")
    placements = {
        "router": (each_path, n, args.max_batch_size, True),
        "shared_queue": (each_path, n, args.max_batch_size, False),
        "one_worker": (merged_path, 1, args.max_batch_size * n, True),
    }
    results = {}
    for name, (path, workers, batch, route) in placements.items():
        with fleet(args, bootstrap, path, logs, workers, batch, route) as (bases, _, prefix):
            results[name] = asyncio.run(converse(args, bootstrap, prefix, bases, workers))
        result = results[name]
        print(
            f"chat, {name:12s} ({workers} worker(s), batch {batch}): prefix hits {result['prefix_hit_rate']:.1%}  "
            f"TTFT p50/p99 {result['ttft_ms']['p50']:.0f}/{result['ttft_ms']['p99']:.0f} ms  {result['seconds']} s",
            flush=True,
        )
    router, shared, one = (results[k]["prefix_hit_rate"] for k in placements)
    results["router_over_one_worker"] = round(router / max(one, 1e-9), 3)
    results["router_over_shared_queue"] = round(router / max(shared, 1e-9), 3)
    print(
        f"chat: router's hit rate {results['router_over_one_worker']}x one worker's, "
        f"{results['router_over_shared_queue']}x the shared queue's",
        flush=True,
    )
    return results
