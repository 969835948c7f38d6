"""`tokenrelay bench tenants`: tenants of one priority on a saturated worker, with fair sharing and without.

Starts a local broker (or uses `--kafka-bootstrap`), one worker (simulated,
`--simulate PROFILE`, or the bundled model with `--simulate ""`) and two
gateways in front of it: one with a tenants file (fair sharing within a
priority, gateway/tenancy/tenants.py and schemas/fair_share.py), one with the same
keys as plain API keys (no tenants: first come, first served). Two mixes, each
on both gateways in turn, closed-loop streams of one priority:

- `heavy/light`: a heavy tenant keeps ten times as many streams going as a
  light one, both of weight 1. Fair sharing should keep the light tenant's
  TTFT near its idle TTFT (measured first, alone).
- `weighted`: two tenants of weights 3 and 1 keep as many streams each, both
  more than the worker's batch. Fair sharing should split the tokens 3 to 1.

Prints, per mix, gateway and tenant: its share of the tokens against its
weight's, tokens/s, and TTFT p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path

import httpx

from tokenrelay.bench.help import HelpFormatter
from tokenrelay.bench.load import Outcome, Request, one_stream, percentiles
from tokenrelay.topology import bench_site, free_port, tokenrelay_processes, wait_ready

MODEL = "tokenrelay-tiny"
# mix -> tenant -> (weight, streams as a multiple of --streams)
MIXES = {"heavy/light": {"heavy": (1, 10), "light": (1, 1)}, "weighted": {"three": (3, 4), "one": (1, 4)}}


def tenants_file(path: Path) -> Path:
    entries = {tenant: weight for mix in MIXES.values() for tenant, (weight, _) in mix.items()}
    path.write_text("".join(f'[tenants.{t}]\nkeys = ["key-{t}"]\nweight = {w}\n' for t, w in entries.items()))
    return path


async def _closed_loop(base: str, tenant: str, streams: int, until: float, tokens: int) -> list[Outcome]:
    """`streams` clients of the tenant, each sending a stream when its last ends, until `until`."""
    outcomes: list[Outcome] = []
    headers = {"Authorization": f"Bearer key-{tenant}"}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits, headers=headers) as client:

        async def loop(index: int) -> None:
            while time.perf_counter() < until:
                request = Request(f"A story of {tenant}, number {index}:", tokens)
                outcomes.append(await one_stream("generate_stream", client, base, MODEL, request))

        await asyncio.gather(*(loop(i) for i in range(streams)))
    return outcomes


async def idle_ttft_ms(base: str, tenant: str, probes: int, tokens: int) -> float:
    """The tenant's TTFT p50 with nothing else running: its requests one after another."""
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer key-{tenant}"}) as client:
        outcomes = [
            await one_stream("generate_stream", client, base, MODEL, Request("Alone:", tokens)) for _ in range(probes)
        ]
    return statistics.median(o.token_times[0] - o.sent_at for o in outcomes if o.token_times) * 1000


async def run_mix(base: str, mix: str, streams: int, warmup_s: float, duration_s: float, tokens: int) -> dict:
    """Each tenant of the mix, over the window after the warm-up: its share of the tokens and its TTFTs."""
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + duration_s)
    tenants = MIXES[mix]
    results = await asyncio.gather(
        *(_closed_loop(base, t, streams * share, window[1], tokens) for t, (_, share) in tenants.items())
    )
    tokens_in = {
        tenant: sum(window[0] <= t < window[1] for o in outcomes if o.error is None for t in o.token_times)
        for tenant, outcomes in zip(tenants, results, strict=True)
    }
    total, weights = sum(tokens_in.values()) or 1, sum(w for w, _ in tenants.values())
    summary = {}
    for (tenant, (weight, _)), outcomes in zip(tenants.items(), results, strict=True):
        sent = [o for o in outcomes if window[0] <= o.sent_at < window[1] and o.error is None and o.token_times]
        ttft = percentiles([o.token_times[0] - o.sent_at for o in sent])
        summary[tenant] = {
            "share": round(tokens_in[tenant] / total, 3),
            "weight_share": round(weight / weights, 3),
            "tokens_per_s": round(tokens_in[tenant] / duration_s, 1),
            "ttft_p50_ms": ttft["p50"],
            "ttft_p99_ms": ttft["p99"],
            "failed": sum(o.error is not None for o in outcomes),
        }
    return summary


async def measure(fair: str, plain: str, args: argparse.Namespace) -> dict:
    result = {"idle_light_ttft_ms": round(await idle_ttft_ms(fair, "light", args.probes, args.tokens), 1)}
    for mix in MIXES:
        for name, base in (("fair", fair), ("first_come", plain)):
            result[f"{mix} {name}"] = await run_mix(base, mix, args.streams, args.warmup, args.duration, args.tokens)
            await asyncio.sleep(1.0)  # the streams of one run end before the next starts
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench tenants", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--simulate", default="bundled-cpu", help="a simulation profile; empty: the bundled model")
    parser.add_argument("--batch", type=int, default=8, help="the worker's --max-batch-size")
    parser.add_argument("--streams", type=int, default=2, help="the light tenant's streams (see the mixes)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--probes", type=int, default=10, help="the light tenant's requests alone, for its idle TTFT")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of each run before its window")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of each run's window")
    parser.add_argument("--kafka-bootstrap", default="", help="empty: a local broker from deploy/kafka/")
    parser.add_argument("--log-level", default="warning", help="of the processes started")
    parser.add_argument("--log-dir", default="", help="keep the processes' logs here; empty: a temporary directory")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    with bench_site("tokenrelay-tenants-", args.log_dir, args.kafka_bootstrap) as (logs, bootstrap):
        kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", f"tenants{uuid.uuid4().hex[:8]}"]
        kafka += ["--log-level", args.log_level]
        simulated = ["--simulate", args.simulate, "--served-model-name", MODEL] if args.simulate else []
        keys = [f"key-{t}" for mix in MIXES.values() for t in mix]
        fair_port, plain_port = free_port(), free_port()
        commands = [
            ["worker", *kafka, "--max-batch-size", str(args.batch), *simulated],
            ["gateway", "--port", str(fair_port), *kafka, "--tenants-file", str(tenants_file(logs / "t.toml"))],
            ["gateway", "--port", str(plain_port), *kafka, "--api-keys", *keys],
        ]
        with tokenrelay_processes(commands, logs) as processes:
            fair, plain = f"http://127.0.0.1:{fair_port}", f"http://127.0.0.1:{plain_port}"
            for base in (fair, plain):
                wait_ready(base, MODEL, processes)
            time.sleep(1.5)  # the worker's first load report
            result = asyncio.run(measure(fair, plain, args))
    print(f"the light tenant alone: TTFT p50 {result['idle_light_ttft_ms']} ms", flush=True)
    for run, tenants in result.items():
        if run == "idle_light_ttft_ms":
            continue
        for tenant, figures in tenants.items():
            print(
                f"{run:<22} {tenant:<6} share {figures['share']:.3f} (weight's {figures['weight_share']:.3f})  "
                f"{figures['tokens_per_s']:8.1f} tok/s  TTFT p50 {figures['ttft_p50_ms']:8.1f} ms  "
                f"p99 {figures['ttft_p99_ms']:8.1f} ms  failed {figures['failed']}",
                flush=True,
            )
    if args.json:
        print(json.dumps(result), flush=True)
