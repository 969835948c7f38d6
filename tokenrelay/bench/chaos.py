"""`tokenrelay bench chaos`: steady load while workers are killed and restarted; nothing may be lost.

Starts `--gateways` gateways and `--workers` workers on one Kafka (a local
broker from deploy/kafka/ unless `--kafka-bootstrap`), streams each kind of
request once with no failure to learn its reference, then for `--duration`
seconds keeps `--concurrency` seeded streams going through the gateways in
turn while every `--kill-every` seconds one worker is SIGKILLed and started
again at once. Every stream is checked against its reference and counted:

- lost: it ended with an error event or an HTTP error, or never got an answer;
- duplicated / missing tokens: its event counts are not 1, 2, 3... or its text
  is not the reference's (a stream with both counts once, as duplicated);
- different: as many tokens as the reference, but other text;
- hung: no end within `--hang-after` seconds.

Also measured: how long after each kill the streams it broke resumed (a
stream is taken as broken by a kill when no token came for `--broken-gap`
seconds around it).

Prints the counts (and, with `--json`, one JSON object on the last line);
exits 1 unless every stream completed as its reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from tokenrelay.bench import plots
from tokenrelay.bench.help import HelpFormatter
from tokenrelay.topology import free_port, local_broker, spawn, tokenrelay_processes, wait_ready

PROMPTS = ["The following example", "def main():\n", "A context manager is", "The os module provides"]
OUTCOMES = ("completed", "lost", "duplicated", "missing", "different", "hung")
FAILURES = OUTCOMES[1:]


@dataclass(frozen=True)
class Kind:
    prompt: str
    seed: int
    max_new_tokens: int

    def body(self) -> dict:
        parameters = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": True,
            "temperature": 0.9,
            "seed": self.seed,
            "details": True,
        }
        return {"text_input": self.prompt, "parameters": parameters}


@dataclass(frozen=True)
class Stream:
    text: str
    counts: list[int]  # generated_tokens of each event
    times: list[float]  # when each event came (time.monotonic())


@dataclass
class Timeline:
    """When things happened in a run, in seconds from the start of the load: for `--plot`."""

    ended: list[tuple[float, str]] = field(default_factory=list)  # each stream's end, and its outcome
    kills: list[float] = field(default_factory=list)
    resume_delays: list[float] = field(default_factory=list)  # seconds from a kill to a broken stream's next token


def kinds(count: int, seed: int) -> list[Kind]:
    rng = random.Random(seed)
    return [Kind(PROMPTS[i % len(PROMPTS)], rng.randrange(1, 2**31), rng.randint(24, 96)) for i in range(count)]


class Refused(RuntimeError):
    """A gateway refused the request before answering it: a 503 while it drains, a connection refused, or one
    closed under the request as the gateway stops (HTTP/1.1's keep-alive race). Send it elsewhere."""


async def stream(client: httpx.AsyncClient, url: str, kind: Kind) -> Stream:
    """One generate_stream; raises RuntimeError for an HTTP error or an error event (Refused: see there)."""
    texts, counts, times = [], [], []
    try:
        response = await client.send(client.build_request("POST", url, json=kind.body()), stream=True)
    except httpx.TransportError as error:  # no answer began
        raise Refused(f"{url}: {type(error).__name__} {error}") from error
    try:
        if response.status_code != 200:
            body = await response.aread()
            if response.status_code == 503 and b"shutting down" in body:
                raise Refused(f"{url} drains")
            raise RuntimeError(f"HTTP {response.status_code}: {body[:200]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[len("data:") :])
                if "error" in event:
                    raise RuntimeError(f"error event: {event}")
                texts.append(event["text_output"])
                counts.append(event["details"]["generated_tokens"])
                times.append(time.monotonic())
    finally:
        await response.aclose()
    return Stream("".join(texts), counts, times)


def received(got: Stream) -> int:
    """The tokens a stream brought its client."""
    return got.counts[-1] if got.counts else 0


def resume_delays(streams: list[Stream], kills: list[float], broken_gap_s: float) -> list[float]:
    """Per stream broken by a kill (no token for `broken_gap_s` around it): seconds from the kill to its next token."""
    delays = []
    for got in streams:
        for before, after in zip(got.times, got.times[1:], strict=False):
            broken_by = [k for k in kills if before <= k < after]
            if broken_by and after - before >= broken_gap_s:
                delays.append(after - broken_by[-1])
    return delays


def judge(got: Stream, expected: Stream) -> str:
    """Which outcome a finished stream is, against its reference."""
    if got.counts == expected.counts and got.text == expected.text:
        return "completed"
    if len(set(got.counts)) < len(got.counts) or len(got.counts) > len(expected.counts):
        return "duplicated"
    if got.counts != expected.counts:
        return "missing"
    return "different"  # as many tokens, other text: not the continuation the reference is


class Workers:
    """Worker processes that can be killed and started again under the same id."""

    def __init__(self, args: list[str], count: int, logs: Path) -> None:
        """`args`: every worker's flags (Kafka's at least)."""
        self._args = args
        self._logs = logs
        self.processes = [self._start(i) for i in range(count)]

    def _start(self, index: int) -> subprocess.Popen:
        return spawn(["worker", *self._args, "--worker-id", f"worker-{index}"], self._logs / f"worker-{index}.log")

    def kill_and_restart(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait()
        self.processes[index] = self._start(index)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


async def run_chaos(
    urls: list[str],
    workers: Workers,
    *,
    duration_s: float,
    kill_every_s: float,
    concurrency: int,
    hang_after_s: float,
    broken_gap_s: float = 1.0,
    model: str = "tokenrelay-tiny",
    seed: int = 0,
    timeline: Timeline | None = None,
) -> dict:
    """The counts of a run (see the module's docstring); `timeline`, if given, is filled in as the run goes."""
    timeline = timeline if timeline is not None else Timeline()
    endpoints = [f"{url}/v2/models/{model}/generate_stream" for url in urls]
    request_kinds = kinds(16, seed)
    tally: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    finished: list[Stream] = []
    kill_times: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(hang_after_s, connect=10)) as client:
        references = await asyncio.gather(
            *(stream(client, endpoints[i % len(endpoints)], k) for i, k in enumerate(request_kinds))
        )
        stop_at = time.monotonic() + duration_s
        started = stop_at - duration_s
        # Progress on stderr, a step a second (none when stderr is not a terminal).
        progress = tqdm(total=round(duration_s), desc="bench chaos", unit="s", disable=None, leave=False)

        def ended(outcome: str) -> None:
            tally[outcome] += 1
            timeline.ended.append((time.monotonic() - started, outcome))

        async def client_loop(first: int) -> None:
            n = first
            while time.monotonic() < stop_at:
                kind = n % len(request_kinds)
                try:
                    got = await asyncio.wait_for(
                        stream(client, endpoints[n % len(endpoints)], request_kinds[kind]), hang_after_s
                    )
                    ended(judge(got, references[kind]))
                    finished.append(got)
                except TimeoutError:
                    ended("hung")
                except (RuntimeError, httpx.HTTPError) as error:
                    ended("lost")
                    errors[f"{type(error).__name__}: {error}"[:120]] += 1
                n += concurrency

        async def ticker() -> None:
            while (elapsed := time.monotonic() - started) < duration_s:
                progress.update(round(elapsed) - progress.n)
                progress.set_postfix(
                    completed=tally["completed"], failed=sum(tally[o] for o in FAILURES), kills=len(kill_times)
                )
                await asyncio.sleep(1)

        async def killer() -> None:
            # At fixed times (every kill_every_s from the start, before the end): how long a restart
            # takes must not change how many kills a run has.
            kills = 0
            while (at := started + (kills + 1) * kill_every_s) < stop_at:
                await asyncio.sleep(at - time.monotonic())
                kill_times.append(time.monotonic())
                workers.kill_and_restart(kills % len(workers.processes))
                kills += 1
            tally["kills"] = kills

        ticking = asyncio.create_task(ticker())
        try:
            await asyncio.gather(killer(), *(client_loop(i) for i in range(concurrency)))
        finally:
            ticking.cancel()
            progress.close()
    delays = sorted(resume_delays(finished, kill_times, broken_gap_s))
    timeline.kills.extend(at - started for at in kill_times)
    timeline.resume_delays.extend(delays)
    return {
        "resumed_after_kill_s": {
            "streams": len(delays),
            "p50": round(delays[len(delays) // 2], 2) if delays else None,
            "max": round(delays[-1], 2) if delays else None,
        },
        "requests": sum(tally[o] for o in OUTCOMES),
        **{outcome: tally[outcome] for outcome in OUTCOMES},
        # Every stream that ended as the client saw it, the references included, and the tokens they brought.
        "streams_ended": len(references) + len(finished),
        "output_tokens": sum(received(s) for s in [*references, *finished]),
        "workers_killed": tally["kills"],
        "errors": dict(errors),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenrelay bench chaos", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between worker kills")
    parser.add_argument("--concurrency", type=int, default=8, help="streams open at once")
    parser.add_argument("--hang-after", type=float, default=60.0, help="seconds after which a stream counts as hung")
    parser.add_argument("--broken-gap", type=float, default=1.0, help="a pause this long around a kill: broken by it")
    parser.add_argument("--kafka-bootstrap", default="", help="empty: a local broker")
    parser.add_argument("--seed", type=int, default=0, help="of the streams' requests")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    parser.add_argument(
        "--plot",
        default="",
        help="write a PNG of streams ended over time, outcomes and resume delays: this .png file, "
        "or chaos.png in this directory",
    )
    args = parser.parse_args(argv)
    timeline = Timeline()
    with tempfile.TemporaryDirectory(prefix="tokenrelay-chaos-") as scratch, ExitStack() as stack:
        logs = Path(scratch)
        bootstrap = args.kafka_bootstrap or stack.enter_context(local_broker(logs / "kafka"))
        kafka = ["--kafka-bootstrap", bootstrap, "--topic-prefix", f"chaos{uuid.uuid4().hex[:8]}"]
        workers = Workers(kafka, args.workers, logs)
        stack.callback(workers.stop)
        ports = [free_port() for _ in range(args.gateways)]
        gateways = stack.enter_context(
            tokenrelay_processes([["gateway", *kafka, "--port", str(port)] for port in ports], logs)
        )
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_ready(url, "tokenrelay-tiny", [*gateways, *workers.processes])
        result = asyncio.run(
            run_chaos(
                urls,
                workers,
                duration_s=args.duration,
                kill_every_s=args.kill_every,
                concurrency=args.concurrency,
                hang_after_s=args.hang_after,
                broken_gap_s=args.broken_gap,
                seed=args.seed,
                timeline=timeline,
            )
        )
    print(
        f"{result['requests']} requests in {args.duration:.0f} s, {result['workers_killed']} workers killed: "
        + ", ".join(f"{outcome} {result[outcome]}" for outcome in OUTCOMES),
        flush=True,
    )
    resumed = result["resumed_after_kill_s"]
    print(
        f"{resumed['streams']} streams broken by a kill resumed after p50 {resumed['p50']} s, max {resumed['max']} s",
        flush=True,
    )
    if args.plot:
        path = plots.target(args.plot, "chaos")
        plots.chaos(result, timeline.ended, timeline.kills, timeline.resume_delays, args.duration, path)
        print(f"plot written to {path}", flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    raise SystemExit(0 if all(result[o] == 0 for o in FAILURES) else 1)
