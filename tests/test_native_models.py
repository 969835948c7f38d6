"""The native model families equal transformers' own models: token for token, log-probability for log-probability.

Each family gets a tiny random checkpoint (two layers, grouped-query
attention) with its peculiarity: Llama 3's rope scaling and an untied head,
Llama 2's linear scaling with every bias, Mistral's one KV head and a head_dim
that is not hidden / heads, Qwen2's QKV bias with yarn, Qwen3's q/k norm. Every
weight, biases and norms included, is drawn at random (transformers starts
biases at 0 and norms at 1, which would hide a bias or a norm loaded in the
wrong place). The checkpoint is written by save_pretrained and loaded through
the native loader and through transformers; in float64, so that no rounding
difference between a batched step and transformers' one-request `generate`
can flip a token.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.devices import TEST_DEVICE
from tests.processes import spawn_tokenrelay, wait_ready
from tests.reference import bundled
from tests.test_engine import Harness, _logprobs, _reference, _tokens
from tokenrelay.topology import free_port
from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig
from workers.engine.model_loader import load_model
from workers.engine.model_runner import KVGeometry
from workers.engine.models.layers import Rotary
from workers.engine.models.weights import CheckpointError

DEVICE = str(TEST_DEVICE)
COMMON = dict(
    vocab_size=32000,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
FAMILIES = {
    "llama3": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama2-bias": dict(
        model_type="llama",
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    ),
    "mistral": dict(model_type="mistral", num_key_value_heads=1, head_dim=32, sliding_window=None),
    "qwen2-yarn": dict(
        model_type="qwen2",
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256),
    ),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def write_checkpoint(directory, family: str, seed: int = 0, **save) -> None:
    options = dict(FAMILIES[family])
    model_type = options.pop("model_type")
    config = AutoConfig.for_model(model_type, **{**COMMON, **options}, architectures=[ARCHITECTURES[model_type]])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            is_norm = name.endswith("norm.weight")
            parameter.copy_(1 + 0.1 * torch.randn_like(parameter) if is_norm else 0.08 * torch.randn_like(parameter))
    model.save_pretrained(directory, **save)
    bundled().tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, the native model, transformers' model for its generate)."""
    directory = tmp_path_factory.mktemp(request.param)
    write_checkpoint(directory, request.param)
    native = load_model(str(directory), DEVICE, "float64")
    reference = load_model(str(directory), DEVICE, "float64", model_impl="transformers")
    assert (native.implementation, reference.implementation) == ("native", "transformers")
    return request.param, directory, native, reference


def _harness(loaded, blocks: int = 64, max_seq_len: int = 512, **config) -> Harness:
    block_bytes = KVGeometry.of(loaded.model).bytes_per_token * 32
    return Harness(loaded, EngineConfig(kv_cache_bytes=blocks * block_bytes, max_seq_len=max_seq_len, **config))


def test_greedy_tokens_equal_transformers_generate_chunked_joined_reused_and_preempted(family):
    _, _, native, reference = family
    rng = random.Random(3)
    shared = [rng.randrange(4, 32000) for _ in range(40)]  # a full block that later prompts reuse
    workload = [(shared + [rng.randrange(4, 32000) for _ in range(n)], m) for n, m in [(5, 14), (30, 10), (1, 12)]]
    workload += [([rng.randrange(4, 32000) for _ in range(n)], m) for n, m in [(2, 9), (77, 8), (20, 13)]]
    # Prompt chunks of at most 24 tokens, and a cache of 9 blocks for six sequences of 1-3 blocks each: long
    # prompts are chunked beside decoding sequences, and the urgent last three preempt the first.
    h = _harness(native, blocks=9, max_batch_size=6, max_tokens_per_step=24, max_seq_len=256)
    try:
        ids = [h.submit(*workload[0])]
        h.wait_for_tokens(ids[0], 2)  # the rest joins a running batch, the shared prefix cached
        ids += [h.submit(p, n, ignore_eos=True) for p, n in workload[1:3]]
        h.wait_for_tokens(ids[2], 1)
        ids += [h.submit(p, n, ignore_eos=True, priority=1) for p, n in workload[3:]]
        results = h.collect(ids)
        stats = h.engine.stats()
    finally:
        h.close()
    expected = [_reference(reference, workload[0][0], workload[0][1])]
    expected += [_greedy_ignoring_eos(reference, p, n) for p, n in workload[1:]]
    assert [_tokens(results[i]) for i in ids] == expected
    assert stats["preemptions"] > 0 and stats["reused_tokens"] >= 32, stats


def _greedy_ignoring_eos(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = reference.model.generate(
            torch.tensor([prompt], device=reference.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def test_log_probabilities_and_seeded_sampling_equal_the_transformers_backed_engines(family):
    name, directory, native, reference = family
    backed = load_model(str(directory), DEVICE, "float64", model_impl="transformers")  # its attention becomes ours
    prompt = [rng for rng in random.Random(5).sample(range(4, 32000), 30)]
    sampled = dict(do_sample=True, temperature=1.1, top_k=40, top_p=0.95, ignore_eos=True)
    answers = {}
    for loaded in (native, backed):
        h = _harness(loaded, max_tokens_per_step=16)  # the prompt comes in two chunks
        try:
            ids = [
                h.submit(prompt, 10, logprobs=4, prompt_logprobs=2, ignore_eos=True),
                *(h.submit(prompt[: 10 + seed], 12, seed=seed, logprobs=0, **sampled) for seed in (1, 2, 3)),
            ]
            results = h.collect(ids)
            answers[loaded.implementation] = [results[i] for i in ids]
        finally:
            h.close()
    greedy = answers["native"][0]
    tokens = _tokens(greedy)
    expected = _logprobs(reference, prompt + tokens)
    for position, event in enumerate(greedy):
        [info] = event.logprobs
        row = expected[len(prompt) - 1 + position]
        assert info.id == tokens[position] == row.argmax().item()
        assert [t.logprob for t in info.top] == pytest.approx(row.topk(4).values.tolist(), abs=1e-9)
    for position, info in enumerate(greedy[0].prompt[1:], start=1):
        assert info.logprob == pytest.approx(expected[position - 1][prompt[position]].item(), abs=1e-9)
    for native_events, backed_events in zip(answers["native"][1:], answers["transformers"][1:], strict=True):
        assert _tokens(native_events) == _tokens(backed_events), name
        native_logprobs = [e.logprobs[0].logprob for e in native_events]
        assert native_logprobs == pytest.approx([e.logprobs[0].logprob for e in backed_events], abs=1e-9)


def test_a_sharded_checkpoint_loads_equal_to_its_single_file(tmp_path):
    write_checkpoint(tmp_path / "single", "qwen3")
    write_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="300KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    single = load_model(str(tmp_path / "single"), DEVICE, "float64").model
    sharded = load_model(str(tmp_path / "sharded"), DEVICE, "float64").model
    assert single.checkpoint_tensors().keys() == sharded.checkpoint_tensors().keys()
    for name, slot in single.checkpoint_tensors().items():
        assert torch.equal(slot.target, sharded.checkpoint_tensors()[name].target), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "remove",
            "tensor model.layers.1.mlp.up_proj.weight is in none of {dir}'s safetensors files (model.safetensors)",
        ),
        (
            "rename",
            "model.safetensors: tensor model.layers.1.mlp.up_projection.weight has no place in Qwen3ForCausalLM",
        ),
        (
            "reshape",
            "model.safetensors: tensor model.layers.1.mlp.up_proj.weight has shape [96, 63], "
            "where the config's Qwen3ForCausalLM needs [96, 64]",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_one_error_naming_the_tensor_and_the_file(tmp_path, change, message):
    write_checkpoint(tmp_path, "qwen3")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    if change == "remove":
        del tensors[name]
    elif change == "rename":
        tensors[name.replace("up_proj", "up_projection")] = tensors.pop(name)
    else:
        tensors[name] = tensors[name][:, :63].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        load_model(str(tmp_path), "cpu", "float64")
    assert str(error.value).startswith(message.format(dir=tmp_path))


def test_auto_runs_native_where_a_family_is_registered_and_native_refuses_what_it_cannot_run(tmp_path):
    assert load_model(str(BUNDLED_MODEL), "cpu").implementation == "native"
    assert load_model(str(BUNDLED_MODEL), "cpu", model_impl="transformers").implementation == "transformers"
    config = AutoConfig.for_model(
        "gpt2", vocab_size=32000, n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bundled().tokenizer.save_pretrained(tmp_path)
    assert load_model(str(tmp_path), "cpu").implementation == "transformers"
    with pytest.raises(ValueError, match="--model-impl native: GPT2LMHeadModel has no native implementation"):
        load_model(str(tmp_path), "cpu", model_impl="native")


def test_rope_types_the_native_models_do_not_compute_are_refused_by_name():
    config = AutoConfig.for_model("llama", **COMMON)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type 'longrope': the native models compute default, linear, dynamic"):
        Rotary(config, 16, torch.device("cpu"))


def test_dynamic_rope_keeps_the_original_frequencies_within_the_original_length_and_grows_past_it():
    """Within it, transformers' own frequencies; past it, those transformers decodes each position with."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model("llama", **{**COMMON, "max_position_embeddings": 64})
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    rotary = Rotary(config, 16, torch.device("cpu"))
    rotary.reserve(100)
    dynamic = ROPE_INIT_FUNCTIONS["dynamic"]
    for position in (0, 63, 64, 99):
        inv_freq, _ = dynamic(config, None, seq_len=max(position + 1, 64) if position >= 64 else None)
        assert torch.allclose(rotary.cos[position], (position * inv_freq).cos(), rtol=0, atol=1e-6), position


def test_a_native_serve_process_imports_neither_transformers_modeling_nor_torch_dynamo(tmp_path):
    """Exactly what the processes imported, as Python's own -X importtime lists it (not a clock)."""
    port = free_port()
    env = {"PYTHONPROFILEIMPORTTIME": "1"}  # inherited by serve's engine process
    process = spawn_tokenrelay(["serve", "--port", str(port)], tmp_path / "serve.log", env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", "tokenrelay-tiny", [process])
        body = {"text_input": "The os module provides", "parameters": {"max_new_tokens": 4}}
        answer = httpx.post(f"http://127.0.0.1:{port}/v2/models/tokenrelay-tiny/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        assert process.stop() == 0, process.log_tail()
    [loaded] = process.events_named("model_loaded")
    assert loaded["implementation"] == "native"
    imported = {line.split("|")[-1].strip() for line in process.raw_lines() if line.startswith("import time:")}
    assert {"workers.engine.models.layers", "transformers.tokenization_utils_tokenizers"} <= imported
    assert {"torch._dynamo", "torchvision", "transformers.modeling_utils"}.isdisjoint(imported)
    assert [m for m in imported if m.startswith("transformers.models.") and ".modeling_" in m] == []
