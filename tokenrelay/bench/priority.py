"""`tokenrelay bench priority`: how fast a priority-1 request starts on a worker full of priority-5 streams.

Starts a local broker (or uses `--kafka-bootstrap`), one worker (the bundled
model, or `--simulate PROFILE`) and one gateway. Measures the time to first
token of `--probes` priority-1 requests sent one after the other on the idle
worker, then keeps twice the worker's batch of priority-5 streams going (from
another process, as other users' would be) and measures the same priority-1
requests again; prints both medians, their
ratio, and the priority-5 streams' median time to first token meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import httpx

from tokenrelay.bench.help import HelpFormatter
from tokenrelay.bench.load import load_client, sse
from tokenrelay.topology import bench_site, free_port, tokenrelay_processes, wait_ready

MODEL = "tokenrelay-tiny"


async def first_token_s(client: httpx.AsyncClient, base: str, priority: int, tokens: int, text: str) -> float:
    """Seconds to the first event of a generate_stream (the whole stream is read)."""
    body = {"text_input": text, "parameters": {"max_new_tokens": tokens, "priority": priority, "details": True}}
    sent, first = time.perf_counter(), None
    async for _ in sse(client, f"{base}/v2/models/{MODEL}/generate_stream", body, "data:"):
        first = first or time.perf_counter()
    return (first or time.perf_counter()) - sent


async def _background_streams(base: str, streams: int, running: Event, stop: Event) -> list[float]:
    """Priority-5 streams, each followed by another, until `stop`; their times to first token."""
    client = load_client()
    times: list[float] = []

    async def busy(index: int) -> None:
        while not stop.is_set():
            times.append(await first_token_s(client, base, 5, 200, f"Background story number {index}:"))

    tasks = [asyncio.create_task(busy(i)) for i in range(streams)]
    running.set()
    await asyncio.gather(*tasks)
    await client.aclose()
    return times


def _background(base: str, streams: int, running: Event, stop: Event, times: Connection) -> None:
    times.send(asyncio.run(_background_streams(base, streams, running, stop)))


async def measure(base: str, probes: int, streams: int, settle_s: float) -> dict:
    # The background load comes from another process, as other users' would: the probes' times
    # must not include waiting on one event loop behind the background streams' reading.
    client = load_client()
    question = "The most urgent question is"
    idle = [await first_token_s(client, base, 1, 8, question) for _ in range(probes)]
    spawn = multiprocessing.get_context("spawn")
    running, stop, (times_out, times_in) = spawn.Event(), spawn.Event(), spawn.Pipe(duplex=False)
    process = spawn.Process(target=_background, args=(base, streams, running, stop, times_in), daemon=True)
    process.start()
    await asyncio.to_thread(running.wait)
    await asyncio.sleep(settle_s)  # every slot taken, and a queue behind them
    loaded = [await first_token_s(client, base, 1, 8, question) for _ in range(probes)]
    stop.set()
    background = await asyncio.to_thread(times_out.recv)
    process.join()
    await client.aclose()
    idle_ms, loaded_ms = statistics.median(idle) * 1000, statistics.median(loaded) * 1000
    return {
        "idle_priority1_ttft_ms": round(idle_ms, 1),
        "loaded_priority1_ttft_ms": round(loaded_ms, 1),
        "loaded_over_idle": round(loaded_ms / idle_ms, 2),
        "loaded_priority5_ttft_ms": round(statistics.median(background) * 1000, 1) if background else None,
        "background_streams": streams,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenrelay bench priority", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--simulate", default="", help="a simulation profile instead of the bundled model")
    parser.add_argument("--batch", type=int, default=64, help="the worker's --max-batch-size")
    parser.add_argument("--probes", type=int, default=10, help="priority-1 requests, idle and loaded")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of background load before the probes")
    parser.add_argument("--kafka-bootstrap", default="", help="empty: a local broker from deploy/kafka/")
    parser.add_argument("--log-level", default="warning", help="of the processes started")
    parser.add_argument("--log-dir", default="", help="keep the processes' logs here; empty: a temporary directory")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    with bench_site("tokenrelay-priority-", args.log_dir, args.kafka_bootstrap) as (logs, bootstrap):
        kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", f"prio{uuid.uuid4().hex[:8]}"]
        kafka += ["--log-level", args.log_level]
        simulated = ["--simulate", args.simulate, "--served-model-name", MODEL] if args.simulate else []
        port = free_port()
        commands = [
            ["worker", *kafka, "--max-batch-size", str(args.batch), *simulated],
            ["gateway", "--port", str(port), *kafka],
        ]
        with tokenrelay_processes(commands, logs) as processes:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, MODEL, processes)
            time.sleep(1.5)  # the worker's first load report
            result = asyncio.run(measure(base, args.probes, 2 * args.batch, args.settle))
    print(
        f"priority-1 TTFT p50: idle {result['idle_priority1_ttft_ms']} ms, under {result['background_streams']} "
        f"priority-5 streams {result['loaded_priority1_ttft_ms']} ms ({result['loaded_over_idle']}x); "
        f"the priority-5 streams' TTFT p50 {result['loaded_priority5_ttft_ms']} ms",
        flush=True,
    )
    if args.json:
        print(json.dumps(result), flush=True)
