"""A model step longer than the Kafka session timeout must not cost the worker its group membership, and one
longer than the engine-stuck timeout stops the worker, whose request then goes on elsewhere.

The worker computes off its event loop, so its consumer keeps heartbeating
and polling while the model runs. Were the model on the loop, the broker
would drop the member after 1 s, rebalance, and the request would be
delivered again.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.processes import free_port, wait_ready
from workers.bundled import BUNDLED_MODEL
from workers.simulated.profile import PROFILES

SESSION_TIMEOUT_MS = 1000  # the least deploy/kafka/broker.sh lets a group ask for


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A randomly initialised Llama big enough that prefilling ~1800 tokens takes about 2 s on a CPU."""
    directory = tmp_path_factory.mktemp("slow-model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=16,  # with 8 the prefill took barely 1 s, and sometimes less
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, directory / name)
    return directory


@pytest.mark.kafka
def test_a_step_longer_than_the_session_timeout_keeps_the_worker_in_its_group(
    slow_model, kafka_bootstrap, spawn, topic_prefix
):
    tokenizer = AutoTokenizer.from_pretrained(slow_model)
    prompt = ""
    while len(tokenizer(prompt)["input_ids"]) < 1800:  # under the default max input of 2048
        prompt += "the quick brown fox jumps over the lazy dog "

    port = free_port()
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    worker = spawn(
        "worker",
        *kafka,
        "--model",
        str(slow_model),
        "--served-model-name",
        "slow",
        "--device",
        "cpu",
        "--kafka-session-timeout-ms",
        str(SESSION_TIMEOUT_MS),
        "--kafka-heartbeat-interval-ms",
        "250",
        "--kafka-max-poll-interval-ms",
        str(SESSION_TIMEOUT_MS),
        "--max-tokens-per-step",
        "2048",  # the whole prompt in one step
    )
    gateway = spawn("gateway", "--port", str(port), *kafka)
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, "slow", [worker, gateway])

    body = {"id": "slow1", "text_input": prompt, "parameters": {"max_new_tokens": 3}}
    with httpx.stream("POST", f"{base_url}/v2/models/slow/generate_stream", json=body, timeout=180) as response:
        assert response.status_code == 200
        events = [json.loads(line[len("data:") :]) for line in response.iter_lines() if line]

    assert len(events) == 3
    # The premise: the prefill step alone outlasted the session timeout.
    assert events[0]["prefill_time"] > SESSION_TIMEOUT_MS, events[0]["prefill_time"]
    assert len(worker.events_named("partitions_assigned")) == 1
    assert worker.events_named("partitions_revoked") == []
    assert worker.events_named("commit_failed") == []
    assert len(worker.events_named("request_admitted")) == 1  # not delivered a second time


@pytest.mark.kafka
async def test_a_step_past_the_engine_stuck_timeout_stops_the_worker_and_its_request_goes_on_elsewhere(
    kafka_bootstrap, spawn, topic_prefix, tmp_path
):
    """A simulated model whose every step takes 60 s: stuck, as far as a timeout of 1 s can tell. The worker
    stops (exit 1, one engine_stuck line) instead of heartbeating on with its request held, and the gateway
    fails the request over: a worker that starts later answers it, with the tokens the seed gives."""
    profile = json.loads((PROFILES / "bundled-cpu.json").read_text())
    stuck = tmp_path / "stuck.json"
    stuck.write_text(json.dumps({**profile, "name": "stuck", "step": {**profile["step"], "base_s": 60.0}}))
    kafka = ["--kafka-bootstrap", kafka_bootstrap, "--topic-prefix", topic_prefix]
    named = ["--served-model-name", "sim"]
    worker = spawn("worker", *kafka, *named, "--simulate", str(stuck), "--engine-stuck-timeout", "1")
    port = free_port()
    gateway = spawn("gateway", "--port", str(port), *kafka)
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, "sim", [worker, gateway])
    body = {"text_input": "a prompt", "parameters": {"max_new_tokens": 3, "seed": 7, "details": True}}
    async with httpx.AsyncClient(timeout=120) as client:
        answer = asyncio.create_task(client.post(f"{base_url}/v2/models/sim/generate", json=body))
        assert await asyncio.to_thread(worker.popen.wait, 60) == 1
        spawn("worker", *kafka, *named, "--simulate", "bundled-cpu")
        answer = await answer
    assert answer.status_code == 200, answer.text
    assert answer.json()["details"]["generated_tokens"] == 3
    (line,) = worker.events_named("engine_stuck")
    assert line["step_s"] > 1
    failovers = gateway.events_named("request_failing_over")
    assert [f["reason"] for f in failovers] == ["worker gone"], failovers
