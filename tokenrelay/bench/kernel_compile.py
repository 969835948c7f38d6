"""Compile the engine's Triton kernels for an H200 (sm_90) ahead of time: no GPU, no driver.

`tokenrelay bench kernels` runs this module as processes of its own
(`python -m tokenrelay.bench.kernel_compile`) without TRITON_INTERPRET: under
the interpreter triton.jit makes functions that cannot be compiled, and a
process that finds them says so instead of reporting nothing. It writes one
JSON line of Triton's and ptxas's versions, then answers each job read from
stdin, one JSON line {"kernel", "dtype", "shape"}, with one JSON line of
that compile's figures. Every job is compiled afresh
(TRITON_ALWAYS_COMPILE), for a cached kernel would come without ptxas's log.

A job's kernel is what the engine would launch: the launch functions of
triton_attention.py, triton_sampling.py, triton_layers.py and triton_lora.py
(workers/engine/kernel_launch.py) are called on meta tensors laid out as the
engine's for the model shape, and their KernelLaunch is compiled with the
specialisation Triton's launcher would give those arguments. ptxas -v's log (TRITON_DUMP_PTXAS_LOG) gives the
registers and spills, Triton's metadata the shared memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas_version
from triton.compiler import ASTSource

from tokenrelay.bench.kernels import SHAPES, ModelShape
from workers.engine import triton_attention, triton_layers, triton_lora, triton_sampling
from workers.engine.config import EngineConfig
from workers.engine.kernel_launch import KernelLaunch

H200 = GPUTarget("cuda", 90, 32)
H200_PROCESSORS = 132  # streaming multiprocessors: the engine's decode split is computed from them
CACHE_BLOCKS = 10_001  # the cache holds what the GPU's memory does: any count, most no multiple of 16
LORA_SLOTS = 4  # adapters in device slots (--max-loras): the grids' size only
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_POINTEE = {dtype: name for name, dtype in DTYPES.items()} | {torch.int64: "i64"}
_DIVISIBLE = [["tt.divisibility", 16]]


def engine_launches(shape: ModelShape, dtype: torch.dtype) -> dict[str, KernelLaunch]:
    """Every Triton kernel the engine launches for a model of this shape, by name, on meta tensors laid out
    as the engine's: a step's query/key/value [tokens, heads, dim] as transformers hands them over (strides
    heads * dim and dim), the cache [kv_heads, blocks, block_size, dim] with the default block size, block
    tables as wide as the decode graphs' (max_seq_len tokens), and the split the engine makes for one
    decoding sequence on an H200 (the most splits, the widest merge); the layer's activations [tokens,
    hidden], q and k the views of one fused QKV projection's output that the models rotate, and rotary
    tables as long as the longest sequence; LoRA pools of the default rank for the widest shrink and expand,
    the fused QKV projection's (three parts' ranks stacked), and the longest shrink, the down projection's,
    B a transposed view of the pool's Bᵀ as models/lora.py passes it. Every pointer is 16-byte aligned, as
    the decode graphs' static buffers and the parts of an eager step's flat int64 tensor are (the prefill
    kernel takes its block tables and lengths without that hint: they start after the decoding rows')."""
    config = EngineConfig()
    block_size, max_blocks = config.block_size, -(-config.max_seq_len // config.block_size)
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim

    def empty(*size: int, of: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(size, dtype=of, device="meta")

    tokens = block_size  # the grid's size only
    query, out = empty(tokens, heads, dim), empty(tokens, heads, dim)
    key, value = empty(tokens, kv_heads, dim), empty(tokens, kv_heads, dim)
    caches = empty(kv_heads, CACHE_BLOCKS, block_size, dim), empty(kv_heads, CACHE_BLOCKS, block_size, dim)
    tables = empty(tokens, max_blocks, of=torch.long)
    lengths, slots = empty(tokens, of=torch.long), empty(tokens, of=torch.long)
    scale = dim**-0.5
    (decode,) = triton_attention.decode_launches(query, *caches, tables, lengths, scale, out, splits=1)
    splits = triton_attention.decode_splits(1, kv_heads, max_blocks, H200_PROCESSORS)
    one = slice(0, 1)
    decode_split, merge = triton_attention.decode_launches(
        query[one], *caches, tables[one], lengths[one], scale, out[one], splits
    )
    chunk_starts, tiles = empty(2, of=torch.long), empty(2, of=torch.long)  # one prompt chunk, one tile
    prefill = triton_attention.prefill_launch(query, *caches, tables, lengths, chunk_starts, tiles, scale, out)
    hidden, intermediate = shape.hidden, shape.intermediate
    qkv = empty(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = (empty(config.max_seq_len, dim // 2, of=torch.float32) for _ in range(2))
    x, residual, normed, summed = (empty(tokens, hidden) for _ in range(4))
    qkv_lora = _lora_launches(tokens, hidden, qkv.shape[1], 3 * config.max_lora_rank, empty)
    down_lora = _lora_launches(tokens, intermediate, hidden, config.max_lora_rank, empty)
    return {
        "store": triton_attention.store_launch(key, value, *caches, slots),
        "decode": decode,
        "decode-split": decode_split,
        "merge": merge,
        "prefill": prefill,
        "noise": triton_sampling.noise_launch(
            empty(tokens, of=torch.long), empty(tokens, shape.vocab, of=torch.float32)
        ),
        "add-rms-norm": triton_layers.add_rms_norm_launch(x, residual, empty(hidden), 1e-5, normed, summed),
        "silu-mul": triton_layers.silu_and_mul_launch(empty(tokens, 2 * intermediate), empty(tokens, intermediate)),
        "rotary": triton_layers.rotary_launch(q, k, empty(tokens, of=torch.long), cos, sin),
        "lora-shrink": qkv_lora[0],
        "lora-expand": qkv_lora[1],
        "lora-shrink-down": down_lora[0],
    }


def _lora_launches(tokens: int, inputs: int, outputs: int, rank: int, empty) -> list[KernelLaunch]:
    """The LoRA shrink's and expand's KernelLaunch for a projection of `tokens` rows and a pool of that rank."""
    a, b = empty(LORA_SLOTS, rank, inputs), empty(LORA_SLOTS, rank, outputs).transpose(1, 2)
    order = empty(tokens, of=torch.long)
    starts, counts = empty(LORA_SLOTS, of=torch.long), empty(LORA_SLOTS, of=torch.long)
    return triton_lora.lora_launches(empty(tokens, outputs), empty(tokens, inputs), a, b, order, starts, counts)


def specialised(launch: KernelLaunch) -> ASTSource:
    """The kernel as Triton's launcher compiles it for these arguments: a pointer's element type, marked
    16-byte aligned where it is; an integer as i32 or i64, marked where it is a multiple of 16, and a
    constant where it is 1; a float as fp32; the constexprs as given. An argument the kernel names in
    do_not_specialize is not marked, nor a constant; in do_not_specialize_on_alignment, not marked."""
    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise TypeError(f"{kernel!r} is not compiled by Triton (TRITON_INTERPRET is set): nothing to check")
    names = kernel.arg_names
    values = dict(zip(names, launch.args, strict=False)) | launch.constexprs
    if set(values) != set(names):
        raise TypeError(f"{kernel.__name__} takes {names}, its launch gives {sorted(values)}")
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        value = values[name]
        path = (index,)
        specialise = not param.do_not_specialize
        marked = specialise and not param.do_not_specialize_on_alignment
        if name in launch.constexprs or (specialise and type(value) is int and value == 1):
            signature[name], constexprs[path] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTEE[value.dtype]
            if marked and value.data_ptr() % 16 == 0:
                attrs[path] = _DIVISIBLE
        elif type(value) is int:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if marked and value % 16 == 0:
                attrs[path] = _DIVISIBLE
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}'s {name}: no Triton type for {type(value).__name__}")
    return ASTSource(kernel, signature, constexprs, attrs)


def ptxas_figures(log: str) -> dict[str, int]:
    """Registers, stack frame and spilled bytes of the one kernel in ptxas -v's log."""
    used = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if used is None or frame is None:
        raise RuntimeError(f"no register figures in ptxas's log (is TRITON_DUMP_PTXAS_LOG set?):\n{log[-2000:]}")
    stack, stores, loads = map(int, frame.groups())
    return {"registers": int(used.group(1)), "stack": stack, "spill_stores": stores, "spill_loads": loads}


def compile_job(kernel: str, dtype: str, shape: str) -> dict:
    """The figures of one kernel's compile for sm_90, or the error it met."""
    result: dict = {"kernel": kernel, "dtype": dtype, "shape": shape}
    launch = engine_launches(SHAPES[shape], DTYPES[dtype])[kernel]
    result["num_warps"] = launch.num_warps
    log = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # where Triton prints ptxas's log
            compiled = triton.compile(specialised(launch), target=H200, options={"num_warps": launch.num_warps})
        result |= ptxas_figures(log.getvalue())
        result["shared"] = compiled.metadata.shared
        result["error"] = None
    except Exception as error:  # a compile error is a finding, reported with its row
        result["error"] = f"{type(error).__name__}: {str(error).strip()[-3000:]}"  # the cause comes last
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def _answer(line: dict) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def main() -> None:
    logged = all(os.environ.get(name) == "1" for name in ("TRITON_DUMP_PTXAS_LOG", "TRITON_ALWAYS_COMPILE"))
    if not logged or triton.knobs.runtime.interpret:
        sys.exit(
            "kernel_compile needs TRITON_DUMP_PTXAS_LOG=1 and TRITON_ALWAYS_COMPILE=1 (ptxas runs and logs every "
            "time, not only when Triton's cache misses), and TRITON_INTERPRET unset: tokenrelay bench kernels runs it"
        )
    release = re.search(r"release ([\d.]+), V([\d.]+)", get_ptxas_version(H200.arch))
    compile_job("noise", "fp32", next(iter(SHAPES)))  # Triton's own start-up, out of the first job's time
    _answer({"triton": triton.__version__, "ptxas": release.group(2) if release else "unknown", "target": "sm_90"})
    for line in sys.stdin:
        job = json.loads(line)
        _answer(compile_job(job["kernel"], job["dtype"], job["shape"]))


if __name__ == "__main__":
    main()
