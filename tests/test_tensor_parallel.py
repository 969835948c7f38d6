"""Tensor-parallel models (workers/engine/parallel.py, ranks.py) on the CPU: real rank processes over gloo.

A model split across 2 or 4 ranks must answer exactly what it answers whole:
each native family's tiny random checkpoint (test_native_models.py) in
float64, through a workload that chunks prompts, reuses a cached prefix and
preempts, with greedy, seeded sampling and log-probabilities; greedy answers
also equal transformers' `generate`. Cases cover KV heads split across the
ranks and replicated on several (fewer KV heads than ranks), a tied and an
untied head, and row-parallel biases. Loading is measured: each rank's peak
is its share of the weights, not the whole. And a rank is a part of its
worker: a SIGTERM drains through rank 0 and ends every rank, and a rank
SIGKILLed mid-stream ends its worker, whose streams fail over to another
worker exactly (on the real broker).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.processes import spawn_tokenrelay, wait_ready
from tests.reference import bundled
from tests.test_engine import _tokens
from tests.test_failover import _body, _joined, _Stream
from tests.test_native_models import _greedy_ignoring_eos, _harness, write_checkpoint
from tokenrelay.bench.shard import LLAMA3_70B, write_llama_checkpoint
from tokenrelay.topology import free_port
from workers.engine.model_loader import load_model

# (family, ranks): Llama 3 (2 KV heads split over 2 ranks, untied head), Mistral (1 KV head on 2 ranks),
# Qwen2 (2 KV heads replicated on 4 ranks, tied head), Llama 2 (biases on o_proj and down_proj: added once,
# after the all-reduce), Qwen3 (q/k norm, 2 KV heads split over 2).
CASES = [("llama3", 2), ("mistral", 2), ("qwen2-yarn", 4), ("llama2-bias", 4), ("qwen3", 2)]


def _workload(loaded) -> tuple[list[tuple[list[int], dict]], list[list], dict]:
    """Requests that run chunked beside decoding ones, reuse a prefix and preempt; their events and the stats."""
    rng = random.Random(3)
    shared = [rng.randrange(4, 32000) for _ in range(40)]  # a full block that later prompts reuse
    sampled = dict(do_sample=True, temperature=1.1, top_k=40, top_p=0.95, ignore_eos=True, logprobs=2)
    requests = [
        (shared + [rng.randrange(4, 32000) for _ in range(5)], dict(max_new_tokens=12, ignore_eos=True, logprobs=3)),
        (shared + [rng.randrange(4, 32000) for _ in range(30)], dict(max_new_tokens=10, seed=7, **sampled)),
        ([rng.randrange(4, 32000) for _ in range(77)], dict(max_new_tokens=8, ignore_eos=True, prompt_logprobs=1)),
        ([rng.randrange(4, 32000) for _ in range(2)], dict(max_new_tokens=9, ignore_eos=True, priority=1)),
        ([rng.randrange(4, 32000) for _ in range(20)], dict(max_new_tokens=13, seed=8, priority=1, **sampled)),
        ([rng.randrange(4, 32000) for _ in range(50)], dict(max_new_tokens=9, ignore_eos=True, priority=1)),
    ]
    # A cache of 9 blocks per rank for six sequences of 1-3 blocks: the urgent last three preempt the first.
    h = _harness(loaded, blocks=9, max_batch_size=6, max_tokens_per_step=24, max_seq_len=256)
    try:
        ids = [h.submit(requests[0][0], **requests[0][1])]
        h.wait_for_tokens(ids[0], 2)  # the rest joins a running batch, the shared prefix cached
        ids += [h.submit(p, **options) for p, options in requests[1:3]]
        h.wait_for_tokens(ids[2], 1)
        ids += [h.submit(p, **options) for p, options in requests[3:]]
        results = h.collect(ids)
        stats = h.engine.stats()
    finally:
        h.close()
    return requests, [results[i] for i in ids], stats


def _logprobs_of(events) -> list[float]:
    generated = [e.logprobs[0].logprob for e in events if e.logprobs]
    tops = [t.logprob for e in events if e.logprobs for t in e.logprobs[0].top]
    prompt = [p.logprob for p in events[0].prompt[1:]] if events[0].prompt else []
    return generated + tops + prompt


@pytest.mark.parametrize(("family", "size"), CASES, ids=[f"{f}-tp{n}" for f, n in CASES])
def test_a_split_model_answers_what_the_whole_one_does_and_transformers_generate(tmp_path, family, size):
    write_checkpoint(tmp_path, family)
    whole = load_model(str(tmp_path), "cpu", "float64")
    requests, expected, expected_stats = _workload(whole)
    split = load_model(str(tmp_path), "cpu", "float64", tensor_parallel_size=size)
    try:
        assert split.tensor_parallel_size == size and split.model.parallel.size == size
        _, answers, stats = _workload(split)
    finally:
        split.close()
    for stats_of in (stats, expected_stats):
        assert stats_of["preemptions"] > 0 and stats_of["reused_tokens"] >= 32, stats_of
    for index, (got, want) in enumerate(zip(answers, expected, strict=True)):
        assert _tokens(got) == _tokens(want), index
        assert _logprobs_of(got) == pytest.approx(_logprobs_of(want), abs=1e-9, rel=0), index
    reference = load_model(str(tmp_path), "cpu", "float64", model_impl="transformers")
    for (prompt, options), got in zip(requests, answers, strict=True):
        if not options.get("do_sample"):
            assert _tokens(got) == _greedy_ignoring_eos(reference, prompt, options["max_new_tokens"])


def _write_large_checkpoint(directory) -> tuple[int, int]:
    """A Llama of about half a GiB in float32, as bench shard writes Llama-3-70B's shape; (its weights' bytes,
    its largest tensor's)."""
    config = dict(
        LLAMA3_70B,
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    total = write_llama_checkpoint(directory, config, 2**40, torch.float32)  # one file
    bundled().tokenizer.save_pretrained(directory)
    return total, 8192 * 1024 * 4


_LOAD = """
import sys
from telemetry.logs import configure
configure()
from workers.engine.model_loader import load_model
load_model(sys.argv[1], "cpu", "float32", tensor_parallel_size=int(sys.argv[2])).close()
"""


def test_each_rank_loads_and_holds_its_share_of_the_weights_not_the_whole(tmp_path):
    """Measured by each rank's own process: the growth of its resident memory while it loads is its share of
    the weights, plus at most three times its part of the largest tensor (the file's pages that part is read
    from, while mapped; the part read; the heap glibc keeps of the previous one) and 64 MiB."""
    total, largest = _write_large_checkpoint(tmp_path)
    size = 2
    loading = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path), str(size)], capture_output=True, text=True, timeout=300
    )
    assert loading.returncode == 0, loading.stderr[-3000:]
    lines = [json.loads(line) for line in loading.stderr.splitlines() if line.startswith("{")]
    loaded = {line["rank"]: line for line in lines if line["event"] == "weights_loaded"}
    assert sorted(loaded) == list(range(size)), loading.stderr[-3000:]
    share, gib = total / size, 2**30
    for rank, line in loaded.items():
        assert line["weights_gib"] == pytest.approx(share / gib, abs=0.002), line
        assert 0.8 * share / gib <= line["peak_gib"] <= (share + 3 * largest / size + 2**26) / gib, (rank, line)
        assert line["peak_gib"] < 0.75 * total / gib  # nowhere near the whole model


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ranks_of(pid: int) -> list[int]:
    """The rank processes whose parent is `pid`."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if parent == pid and b"workers.engine.ranks" in command:
            children.append(int(entry))
    return children


def test_a_sigterm_drains_a_split_worker_through_rank_0_and_ends_every_rank(tmp_path):
    """serve with two ranks meeting at --distributed-init: a stream under way when SIGTERM comes runs to its end,
    then both ranks exit."""
    port = free_port()
    rendezvous = f"tcp://127.0.0.1:{free_port()}"  # the flag's own port
    serve = ["serve", "--port", str(port), "--tensor-parallel-size", "2", "--distributed-init", rendezvous]
    process = spawn_tokenrelay(serve, tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    events: list[dict] = []
    try:
        wait_ready(url, "tokenrelay-tiny", [process])
        [started] = process.events_named("tensor_parallel_ranks_started")
        [rank] = started["pids"]
        assert _alive(rank) and started["init"] == rendezvous
        parameters = {"max_new_tokens": 64, "do_sample": True, "seed": 5, "details": True}
        body = {"text_input": "The os module", "parameters": parameters}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v2/models/tokenrelay-tiny/generate_stream", json=body, timeout=60) as r:
                events.extend(json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:"))

        client = threading.Thread(target=stream)
        client.start()
        while not process.events_named("request_admitted") and client.is_alive():
            time.sleep(0.05)
        process.popen.send_signal(signal.SIGTERM)
        client.join(60)
    finally:
        status = process.stop()
    assert status == 0, process.log_tail()
    counts = [e["details"]["generated_tokens"] for e in events]
    assert counts == list(range(1, len(events) + 1)) and events[-1]["details"]["finish_reason"], events[-1:]
    assert any("worker_drained" == e["event"] for e in process.events()), process.log_tail()
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)
    [loaded] = process.events_named("model_loaded")
    assert loaded["tensor_parallel_size"] == 2


async def _seeded_streams(url: str, count: int, while_running=None) -> list[_Stream]:
    streams = [_Stream() for _ in range(count)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        tasks = [asyncio.create_task(s.run(client, url, _body(i))) for i, s in enumerate(streams)]
        if while_running is not None:
            await while_running(streams)
        await asyncio.wait_for(asyncio.gather(*tasks), 150)  # none hangs
    return streams


@pytest.mark.kafka
async def test_a_rank_killed_mid_stream_ends_its_worker_and_its_streams_resume_identically(
    kafka_bootstrap, topic_prefix, spawn
):
    """A worker split over two ranks beside a whole one, on the real broker: SIGKILL its rank 1 mid-stream.
    Rank 0 says which rank died and exits non-zero, no rank is left, and the gateway fails the worker's
    requests over to the other, whose continuations equal the uninterrupted streams (float64 on both, so a
    split and a whole model draw the same tokens)."""
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix, "--dtype", "float64"]
    metrics = f"127.0.0.1:{free_port()}"
    split = spawn("worker", *kafka, "--worker-id", "split", "--tensor-parallel-size", "2", "--metrics-address", metrics)
    whole = spawn("worker", *kafka, "--worker-id", "whole")
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka[:4])
    wait_ready(f"http://127.0.0.1:{port}", "tokenrelay-tiny", [split, whole, gateway])
    deadline = time.monotonic() + 60
    while not (_joined(split) and _joined(whole)):
        assert time.monotonic() < deadline, split.log_tail()
        await asyncio.sleep(0.2)
    [started] = split.events_named("tensor_parallel_ranks_started")
    [rank] = started["pids"]
    exported = httpx.get(f"http://{metrics}/metrics", timeout=10).text
    assert 'tokenrelay_worker_tensor_parallel_size{model="tokenrelay-tiny"} 2.0' in exported
    url = f"http://127.0.0.1:{port}/v2/models/tokenrelay-tiny/generate_stream"
    reference = await _seeded_streams(url, 16)
    admitted_before = len(split.events_named("request_admitted"))
    # The gateway routes by the workers' load reports: one sent as the split worker's last reference stream ended
    # may come after the next run is routed, which then all goes to the whole worker, seen idle (as in CI once).
    # A report comes at least once a heartbeat (1 s).
    await asyncio.sleep(1.5)

    async def kill_rank(streams: list[_Stream]) -> None:
        deadline = time.monotonic() + 60
        while (
            sum(len(s.counts) >= 8 for s in streams) < 8
            or len(split.events_named("request_admitted")) == admitted_before
        ):
            assert time.monotonic() < deadline, f"the split worker took none of the streams: {split.log_tail()}"
            await asyncio.sleep(0.05)
        os.kill(rank, signal.SIGKILL)

    failed = await _seeded_streams(url, 16, kill_rank)
    for i, (expected, got) in enumerate(zip(reference, failed, strict=True)):
        assert got.counts == list(range(1, len(got.counts) + 1)), i  # no token missing, none twice
        assert "".join(got.texts) == "".join(expected.texts), i
    failovers = gateway.events_named("request_failing_over")
    assert failovers and {(f["reason"], f["worker_id"]) for f in failovers} == {("worker gone", "split")}, failovers
    assert split.popen.wait(30) == 1
    [died] = split.events_named("tensor_parallel_rank_died")
    assert (died["rank"], died["pid"]) == (1, rank)
    assert not _alive(rank) and _ranks_of(split.popen.pid) == []
    assert whole.popen.poll() is None


def test_a_size_the_model_cannot_be_split_by_is_refused_before_any_rank_starts(tmp_path):
    write_checkpoint(tmp_path, "llama3")  # 4 query heads, 2 KV heads, MLP 96
    with pytest.raises(ValueError, match=r"tensor parallel size 3 must divide the model's attention heads \(4\)"):
        load_model(str(tmp_path), "cpu", "float64", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="splits the native model code's families: not --model-impl transformers"):
        load_model(str(tmp_path), "cpu", "float64", model_impl="transformers", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"size 8 must divide the model's attention heads \(4\)"):
        load_model(str(tmp_path), "cpu", "float64", tensor_parallel_size=8)
    with pytest.raises(ValueError, match=r"--distributed-init '127.0.0.1:29500': tcp://HOST:PORT is the form"):
        load_model(str(tmp_path), "cpu", "float64", tensor_parallel_size=2, distributed_init="127.0.0.1:29500")
    assert _ranks_of(os.getpid()) == []
