"""LoRA adapters: read and checked, computed per row in mixed steps, equal to PEFT's PeftModel, served by name.

The bundled adapters (workers/bundled/training/adapters.py) are the references'
inputs: `shout` (rank 8 on all seven projections) answers in upper case,
`code` (rank 16, rsLoRA, four projections) in Python. In float64 the engine's
greedy tokens equal PEFT's on transformers' model, alone and with both
adapters and the base model in one step. The engine runs on the CPU, or on a
GPU with TOKENRELAY_TEST_DEVICE=cuda (its LoRA products in triton_lora.py
there); PEFT's reference runs on the CPU, where float64 is exact and cheapest.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
import torch

from schemas.adapters import AdapterError, LoraSupport, check_fits, read_adapter
from tests.devices import TEST_DEVICE
from tests.processes import TOKENRELAY, metric, serving
from tests.test_engine import Harness, _tokens
from workers.bundled import BUNDLED_ADAPTERS, BUNDLED_MODEL
from workers.engine.adapters import Adapters
from workers.engine.config import EngineConfig
from workers.engine.lora_rows import LoraRows
from workers.engine.model_loader import load_model
from workers.engine.models.lora import LoraPool

PROMPTS = ["The meaning of life is", "Hello, my name is", "Python is a programming language that", "def main("]
SHOUT, CODE = (str(BUNDLED_ADAPTERS[name]) for name in ("shout", "code"))
BUNDLED_SUPPORT = LoraSupport(
    max_rank=64,
    layers=4,
    modules={
        "q_proj": (256, 256),
        "k_proj": (256, 128),
        "v_proj": (256, 128),
        "o_proj": (256, 256),
        "gate_proj": (256, 640),
        "up_proj": (256, 640),
        "down_proj": (640, 256),
    },
)


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64")


@pytest.fixture(scope="module")
def peft_tokens(loaded):
    """PEFT's greedy tokens for each (adapter, prompt): PeftModel on transformers' model, float64."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    answers = {}
    for name, path in (("shout", SHOUT), ("code", CODE)):
        base = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float64)
        model = PeftModel.from_pretrained(base, path).to(torch.float64).eval()  # its adapter's weights too
        for prompt in PROMPTS:
            ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
            eos = next((i for i, t in enumerate(out) if t in loaded.eos_token_ids), None)
            answers[name, prompt] = out if eos is None else out[: eos + 1]
    return answers


@pytest.fixture
def engine(loaded):
    harness = Harness(loaded, EngineConfig(kv_cache_bytes=64 << 20, max_loras=2))
    yield harness
    harness.close()


def _run(harness: Harness, requests: list[tuple[str, str | None]], **sampling) -> list[list[int]]:
    ids = [
        harness.submit(prompt, max_new_tokens=16, adapter=name, adapter_path=path, **sampling)
        for prompt, (name, path) in requests
    ]
    events = harness.collect(ids)
    for request_id in ids:
        assert events[request_id][-1].error is None, events[request_id][-1].error
    return [_tokens(events[request_id]) for request_id in ids]


ADAPTERS = {"shout": ("shout", SHOUT), "code": ("code", CODE), None: (None, None)}


def test_each_bundled_adapter_greedy_equals_peft_and_mixed_steps_equal_each_alone(engine, loaded, peft_tokens):
    base = {p: _run(engine, [(p, ADAPTERS[None])])[0] for p in PROMPTS}
    for name in ("shout", "code"):
        for prompt in PROMPTS:
            alone = _run(engine, [(prompt, ADAPTERS[name])])[0]
            assert alone == peft_tokens[name, prompt], (name, prompt)
            assert alone != base[prompt], (name, prompt)
    shout_text = loaded.tokenizer.decode(peft_tokens["shout", PROMPTS[0]])
    letters = [c for c in shout_text if c.isalpha()]
    assert sum(c.isupper() for c in letters) >= 0.9 * len(letters), shout_text
    mixed = [(p, ADAPTERS[name]) for p in PROMPTS for name in ("shout", None, "code")]
    expected = [peft_tokens[name, p] if name else base[p] for p in PROMPTS for name in ("shout", None, "code")]
    assert _run(engine, mixed) == expected


def test_seeded_sampling_under_adapters_is_the_same_alone_and_batched(engine):
    sampling = {"do_sample": True, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    requests = [(PROMPTS[0], ADAPTERS["shout"]), (PROMPTS[1], ADAPTERS["code"]), (PROMPTS[2], ADAPTERS[None])]
    alone = [_run(engine, [request], **sampling)[0] for request in requests]
    assert _run(engine, requests, **sampling) == alone


def test_a_block_computed_under_one_adapter_never_serves_another(engine):
    prompt = " ".join(["a long shared prompt that fills more than two blocks of the cache"] * 8)
    reused = engine.engine.stats()["reused_tokens"]
    first = _run(engine, [(prompt, ADAPTERS["shout"])])[0]
    for name in ("code", None):
        _run(engine, [(prompt, ADAPTERS[name])])
        assert engine.engine.stats()["reused_tokens"] == reused, name  # nothing of shout's blocks
    assert _run(engine, [(prompt, ADAPTERS["shout"])])[0] == first
    assert engine.engine.stats()["reused_tokens"] > reused  # its own adapter's blocks are found again


def test_one_device_slot_serves_two_adapters_in_turn_and_counts_its_loads(loaded, peft_tokens):
    harness = Harness(loaded, EngineConfig(kv_cache_bytes=64 << 20, max_loras=1, max_cpu_loras=1))
    try:
        requests = [(PROMPTS[0], ADAPTERS["shout"]), (PROMPTS[0], ADAPTERS["code"]), (PROMPTS[1], ADAPTERS["shout"])]
        assert _run(harness, requests) == [
            peft_tokens["shout", PROMPTS[0]],
            peft_tokens["code", PROMPTS[0]],
            peft_tokens["shout", PROMPTS[1]],
        ]
        counts = harness.engine.adapters.counts
        assert counts.loads == counts.evictions + 1 >= 2
        assert harness.engine.adapters.resident()[0] in (["shout"], ["code"])
    finally:
        harness.close()


def test_an_adapter_that_cannot_be_served_ends_its_request_with_the_reason(engine, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(SHOUT, broken)
    (broken / "adapter_config.json").write_text("{not json")
    request_id = engine.submit(PROMPTS[0], adapter="broken", adapter_path=str(broken))
    last = engine.collect([request_id])[request_id][-1]
    assert last.error is not None and "adapter_config.json is not readable JSON" in last.error.message


def _adapter_with(tmp_path, **config):
    path = tmp_path / "adapter"
    shutil.copytree(SHOUT, path, dirs_exist_ok=True)
    written = json.loads((path / "adapter_config.json").read_text()) | config
    (path / "adapter_config.json").write_text(json.dumps(written))
    return path


def test_the_bundled_adapters_read_as_peft_wrote_them():
    shout, code = read_adapter(SHOUT, 64), read_adapter(CODE, 64)
    assert (shout.rank, shout.scaling, len(shout.targets)) == (8, 16 / 8, 7)
    assert (code.rank, code.scaling, code.targets) == (16, 8 / 4, ("q_proj", "v_proj", "o_proj", "down_proj"))
    check_fits(shout, BUNDLED_SUPPORT)
    check_fits(code, BUNDLED_SUPPORT)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"r": 128}, "its rank r=128 is above this model's limit 64"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules embed_tokens are not served"),
        ({"use_dora": True}, "use_dora=True is not served"),
        ({"peft_type": "PREFIX_TUNING"}, "only LORA adapters are served"),
        ({"r": "eight"}, "r must be a positive integer"),
    ],
)
def test_an_adapter_is_refused_naming_the_reason(tmp_path, config, reason):
    with pytest.raises(AdapterError, match=reason):
        read_adapter(_adapter_with(tmp_path, **config), 64)


def test_an_adapter_whose_shapes_do_not_fit_the_model_is_refused(tmp_path):
    spec = read_adapter(SHOUT, 64)
    smaller = BUNDLED_SUPPORT.model_copy(update={"modules": BUNDLED_SUPPORT.modules | {"q_proj": (128, 256)}})
    with pytest.raises(
        AdapterError, match=r"lora_A of layer 0's q_proj is \[8, 256\]; the model's q_proj takes \[8, 128\]"
    ):
        check_fits(spec, smaller)
    without = BUNDLED_SUPPORT.model_copy(
        update={"modules": {k: v for k, v in BUNDLED_SUPPORT.modules.items() if k != "up_proj"}}
    )
    with pytest.raises(AdapterError, match="the model has no up_proj to adapt"):
        check_fits(spec, without)
    with pytest.raises(AdapterError, match=f"no adapter directory at {tmp_path / 'none'}"):
        read_adapter(tmp_path / "none", 64)


def test_serve_answers_for_each_adapter_by_its_name_on_every_api(tmp_path):
    with serving(tmp_path, "--lora", f"shout={SHOUT}", "--lora", f"code={CODE}") as served:
        models = {card["id"]: card for card in httpx.get(served.url("/v1/models")).json()["data"]}
        assert models["shout"]["parent"] == models["code"]["parent"] == "tokenrelay-tiny"
        assert models["tokenrelay-tiny"]["parent"] is None
        body = {"text_input": PROMPTS[0], "parameters": {"max_new_tokens": 12}}
        native = {
            name: httpx.post(served.url(f"/v2/models/{name}/generate"), json=body, timeout=60).json()["text_output"]
            for name in ("shout", "code", "tokenrelay-tiny")
        }
        assert len(set(native.values())) == 3
        letters = [c for c in native["shout"] if c.isalpha()]
        assert sum(c.isupper() for c in letters) >= 0.9 * len(letters), native["shout"]
        tgi = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 12, "adapter_id": "shout"}}
        assert httpx.post(served.url("/generate"), json=tgi, timeout=60).json()["generated_text"] == native["shout"]
        completion = {"model": "shout", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        answer = httpx.post(served.url("/v1/completions"), json=completion, timeout=60).json()
        assert answer["model"] == "shout" and answer["choices"][0]["text"] == native["shout"]
        metrics = httpx.get(served.url("/metrics")).text
        assert (
            metric(metrics, "tokenrelay_worker_adapter_requests_total", model="tokenrelay-tiny", adapter="shout") == 3
        )
        tokens = metric(metrics, "tokenrelay_worker_adapter_tokens_total", model="tokenrelay-tiny", adapter="code")
        assert tokens == 12
        missing = httpx.post(served.url("/v1/completions"), json=completion | {"model": "whisper"}, timeout=60)
        assert missing.status_code == 404
        assert (
            missing.json()["error"]["message"]
            == "model whisper is not served here; served: code, shout, tokenrelay-tiny"
        )


def test_serve_refuses_to_start_with_an_adapter_it_cannot_serve(tmp_path):
    too_large = _adapter_with(tmp_path, r=8)
    args = ["serve", "--port", "0", "--lora", f"big={too_large}", "--max-lora-rank", "4"]
    ended = subprocess.run([TOKENRELAY, *args], capture_output=True, text=True, timeout=180)
    assert ended.returncode == 1
    errors = [json.loads(line).get("error", "") for line in ended.stderr.splitlines() if line.startswith("{")]
    reason = f"--lora: adapter at {too_large}: its rank r=8 is above this model's limit 4 (--max-lora-rank)"
    assert reason in errors, errors  # the engine process's line; serve's own then says it exited


def test_a_load_takes_a_free_slot_then_one_the_router_names_then_the_least_recently_used():
    spec, written = read_adapter(BUNDLED_ADAPTERS["shout"], 64), []
    adapters = Adapters(3, 8, lambda path: (spec, {}), lambda slot, adapter: written.append((slot, adapter.name)))
    pinned = {name: adapters.pin(name, f"/{name}") for name in ("a", "b", "c", "d", "e")}
    slots = [adapters.acquire(pinned[name], ("c",)) for name in ("a", "b", "c")]  # free slots first, in order
    assert slots == [0, 1, 2] and adapters.resident() == (["c", "b", "a"], [])
    adapters.release(slots[2])
    assert adapters.resident() == (["c", "b", "a"], ["c"])
    for slot in slots[:2]:
        adapters.release(slot)
    assert adapters.acquire(pinned["d"], ("c",)) == 2  # named: c, though a was used longer ago
    assert adapters.acquire(pinned["e"], ("c",)) == 0  # c is held now: the least recently used, a
    assert written[3:] == [(2, "d"), (0, "e")] and adapters.counts.evictions == 2


@pytest.mark.parametrize(("adapted", "base"), [(1, 3), (2, 1), (6, 2)])
def test_a_pools_products_on_the_cpu_equal_each_rows_own_adapters(adapted, base):
    """Each CPU path of LoraPool.add (one adapter of some rows; several, masked, its stacked matrices copied or
    the pools' own) against each row's x·Aᵀ·Bᵀ under its own slot, in float64; rows of no slot keep y as is.
    Each slot's adapter is distinct and as large as y, so a row given another's (or none) is far off."""
    generator = torch.Generator().manual_seed(3)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, dtype=torch.float64)

    pool = LoraPool(4, 8, 24, {"q": (0, 16), "k": (16, 8)}, "cpu", torch.float64)
    for slot in range(4):
        weights = {name: (randn(8, 24), randn(rows, 8)) for name, rows in (("q", 16), ("k", 8))}
        pool.write(slot, weights, scaling=0.5)
    slots = [slot % (4 if adapted > 1 else 1) + (adapted == 1) for slot in range(adapted)] + [-1] * base
    slots = torch.tensor(slots)[torch.randperm(len(slots), generator=generator)]
    x, y = randn(len(slots), 24), randn(len(slots), 24)
    expected = y.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[row] += (x[row] @ pool.a[slot].T) @ pool.b[slot]
    pool.add(y, x, LoraRows(slots, 8, 4))
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(y[slots < 0], expected[slots < 0])
