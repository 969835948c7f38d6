"""`tokenrelay bench shard`: Llama-3-70B's shape split across ranks: what each rank loads, and that it generates.

MindIE's example model, llama3-70b, is ~140 GB in bf16: more than a GPU
holds. This writes its published configuration (hidden 8192, 64 query and 8
KV heads, MLP 28672, vocabulary 128256) with `--layers` of its 80 layers,
random bf16 weights, as a sharded safetensors checkpoint of `--shard-gib`
files (written tensor by tensor: this process never holds the model either),
then loads it split across `--tensor-parallel-size` ranks in a process of
its own (rank 0) and has it generate a few greedy tokens. It prints each
rank's weights and its peak while loading (the growth of its resident
memory: what it holds, the slices in flight and the file pages they are read
from), the whole model's weights, the time to load and per token, and, for
the full 80 layers, the weights and KV cache per rank that tensor
parallelism at that size would take (docs/models.md: a 70B on one 8-GPU node).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenrelay.bench.help import HelpFormatter
from workers.bundled import BUNDLED_MODEL

LLAMA3_70B = dict(  # meta-llama/Meta-Llama-3-70B's config.json
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
_GIB = 2**30

_RANK_0 = """
import json, sys, time
from telemetry.logs import configure
configure()
from schemas.messages import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.model_loader import load_model
from workers.engine.request import EngineRequest
import queue, uuid

directory, size, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
started = time.perf_counter()
loaded = load_model(directory, "cpu", "bfloat16", tensor_parallel_size=size)
load_s = time.perf_counter() - started
events = queue.SimpleQueue()
config = EngineConfig(kv_cache_bytes=2**28, max_seq_len=256)
engine = Engine(loaded, config, lambda batch: [events.put(e) for e in batch])
engine.start()
prompt = [(7919 * i) % 32000 for i in range(1, 17)]
request = EngineRequest(request_id=uuid.uuid4().hex, model="bench", prompt_token_ids=prompt,
    sampling=SamplingParams(seed=0, max_new_tokens=tokens, ignore_eos=True), deadline=time.time() + 3600)
began = time.perf_counter()
engine.submit(request, time.monotonic())
generated, times = [], []
while True:
    event = events.get()
    generated += event.token_ids
    times.append(time.perf_counter() - began)
    if event.finish_reason is not None:
        break
engine.stop()
loaded.close()
gaps = [b - a for a, b in zip(times, times[1:])]
print(json.dumps({"load_s": load_s, "first_token_s": times[0], "per_token_s": sum(gaps) / max(1, len(gaps)),
    "tokens": generated}))
"""


def write_llama_checkpoint(directory: Path, config: dict, shard_bytes: int, dtype=None) -> int:
    """Random weights of a Llama `config` (bf16, or `dtype`) as sharded safetensors, a tensor at a time; the
    weights' bytes."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.bfloat16

    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (hidden, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, hidden),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (inner, hidden),
            f"{prefix}.mlp.up_proj.weight": (inner, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inner),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        files.append(list(shard))
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in shapes.items():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=dtype)
        else:  # scaled so that activations stay of order 1 through the layers
            tensor = (torch.randn(shape, generator=generator) * shape[1] ** -0.5).to(dtype)
        size = tensor.numel() * tensor.element_size()
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + size > shard_bytes:
            flush()
        shard[name] = tensor
        total += size
    flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(json.dumps(config))
    return total


def per_rank(config: dict, size: int, context_tokens: int) -> dict:
    """The weights and the KV cache of `context_tokens` tokens on each rank at tensor-parallel size `size`."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    head_dim = hidden // heads
    layer = 2 * hidden * hidden + 2 * kv_heads * head_dim * hidden + 3 * hidden * inner
    weights = (layers * layer + 2 * vocab * hidden) * 2 / size + (2 * layers + 1) * hidden * 2
    rank_kv_heads = max(1, kv_heads // size)
    kv = 2 * layers * rank_kv_heads * head_dim * 2 * context_tokens
    return {"weights_gib": round(weights / _GIB, 2), "kv_cache_gib": round(kv / _GIB, 2)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="tokenrelay bench shard", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="of Llama-3-70B's 80 (4: about 11 GiB of weights)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks the model is split across")
    parser.add_argument("--shard-gib", type=float, default=2.0, help="largest safetensors file of the checkpoint")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens generated")
    parser.add_argument(
        "--directory", default="", help="write the checkpoint here and keep it; default: a temporary one"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    directory = Path(args.directory or tempfile.mkdtemp(prefix="tokenrelay-shard-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        config = {**LLAMA3_70B, "num_hidden_layers": args.layers}
        total = write_llama_checkpoint(directory, config, int(args.shard_gib * _GIB))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (BUNDLED_MODEL / name).exists():
                shutil.copy(BUNDLED_MODEL / name, directory / name)
        print(f"checkpoint: Llama-3-70B's shape, {args.layers} layers, {total / _GIB:.2f} GiB bf16", flush=True)
        run = subprocess.run(
            [sys.executable, "-c", _RANK_0, str(directory), str(args.tensor_parallel_size), str(args.tokens)],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            sys.exit(f"the split model failed:\n{run.stderr[-4000:]}")
        lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
        ranks = sorted((e for e in lines if e.get("event") == "weights_loaded"), key=lambda e: e["rank"])
        result = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        if not args.directory:
            shutil.rmtree(directory, ignore_errors=True)
    share = total / _GIB / args.tensor_parallel_size
    for rank in ranks:
        print(
            f"rank {rank['rank']}: weights {rank['weights_gib']:.2f} GiB, "
            f"peak while loading {rank['peak_gib']:.2f} GiB "
            f"({rank['peak_gib'] / share:.2f}x its share of {share:.2f} GiB; the whole model is {total / _GIB:.2f})",
            flush=True,
        )
    print(
        f"loaded in {result['load_s']:.1f} s; first token {result['first_token_s']:.2f} s, then "
        f"{result['per_token_s']:.2f} s per token; tokens {result['tokens']}",
        flush=True,
    )
    full = {size: per_rank(LLAMA3_70B, size, 128 * 1024) for size in (2, 4, 8)}
    for size, need in full.items():
        print(
            f"all 80 layers at tensor-parallel size {size}: {need['weights_gib']} GiB of weights per rank, "
            f"{need['kv_cache_gib']} GiB of KV cache per 128k tokens per rank",
            flush=True,
        )
    if args.json:
        print(json.dumps({"weights_gib": total / _GIB, "ranks": ranks, **result, "full_model_per_rank": full}))
