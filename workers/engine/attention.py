"""Attention over the paged KV cache, for the native models and for transformers' (models/transformers_backed.py).

The model runner packs a step's tokens from every sequence into one row; each
layer hands its query, key and value of those rows to `attend`, which
1. writes the new keys and values into their sequences' cache slots, then
2. attends, per sequence, to everything that sequence has cached. The packed
   rows hold first the sequences decoding one token, then the prompt chunks.

Three sets of kernels do it, chosen by the model runner (`kernels_for`):
- "triton" (GPUs): triton_attention.py, reading the cache in place, one
  launch for all decoding sequences and one for all prompt chunks;
- "cpu": decoding sequences through a small C++ kernel (paged_decode.cpp)
  that reads each sequence's keys and values in place, twice as fast as
  gathering them first; each prompt chunk through PyTorch's SDPA;
- "torch": the same without the C++ kernel (no compiler): decoding
  sequences' blocks are gathered into one padded batch, with a mask.

The cache is laid out [kv_heads, blocks, block_size, dim] so that one (KV
head, block) tile is contiguous for the kernels, and gathering a batch's
blocks along dim 1 yields keys [kv_heads, sequences, tokens, dim] that are
contiguous: scaled_dot_product_attention is three times slower on strided
keys. Query heads that share a KV head (grouped-query attention) are folded
next to the query rows, so keys and values are never repeated.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from workers.engine.lora_rows import LoraRows

_KERNEL_SOURCE = pathlib.Path(__file__).with_name("paged_decode.cpp")
log = structlog.get_logger(__name__)


@functools.cache
def decode_kernel():
    """The C++ decode kernel, compiled for this CPU on first use (cached on disk); None if it cannot be built."""
    from torch.utils.cpp_extension import load

    # -march=native code must not be loaded on another CPU: the build cache is keyed by this CPU's features.
    flags = next(
        (line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
    )
    name = "tokenrelay_paged_decode_" + hashlib.sha256(flags.encode()).hexdigest()[:12]
    # Built beside the source: checkouts sharing torch's cache folder would rebuild each other's kernel.
    build: pathlib.Path | None = _KERNEL_SOURCE.with_name(".kernel-build") / name
    try:
        build.mkdir(parents=True, exist_ok=True)
    except OSError:  # installed read-only: torch's own cache folder
        build = None
    try:
        # -fopenmp: at::parallel_for's OpenMP loop is inline in ATen's headers, so without it the kernel runs
        # on one thread (it links no OpenMP runtime of its own: torch's, already loaded, serves it).
        return load(
            name=name,
            sources=[str(_KERNEL_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            build_directory=str(build) if build else None,
        )
    except Exception as error:  # no compiler, no ninja: the PyTorch path still works
        log.warning("decode_kernel_unavailable", error=str(error)[:500])
        return None


KERNELS = ("triton", "cpu", "torch")


def kernels_for(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    return "cpu" if decode_kernel() is not None else "torch"


@dataclass(frozen=True)
class PromptChunk:
    """A prompt chunk, for the "cpu" and "torch" kernels, which attend chunk by chunk."""

    start: int  # rows of the packed batch
    end: int
    # None for a chunk that starts its sequence: it attends to itself alone, causally, from this step's
    # keys and values. Else the sequence's block ids and what each query row sees of them,
    # [1, 1, end - start, len(blocks) * block_size].
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class PagedBatch:
    """Where a step's tokens go in the cache, and what each attends to; shared by all layers.

    Rows [0, decodes) of the packed batch are sequences decoding one token;
    prompt chunks follow. `block_tables` and `lengths` have a row per
    decoding sequence, then one per prompt chunk (read by the "triton"
    kernels; the others take `prompts`).
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), [kv_heads, blocks, block_size, dim]
    kernels: str  # "triton", "cpu" or "torch"
    slots: torch.Tensor  # [tokens]: the cache slot (block * block_size + offset) of each token; -1: none
    decodes: int
    block_tables: torch.Tensor  # [sequences, max blocks]: their block ids, padded with block 0
    lengths: torch.Tensor  # [sequences]: their cached tokens, this step's included
    splits: int = 1  # "triton": programs that share each decoding sequence's blocks
    query_starts: torch.Tensor | None = None  # "triton": [chunks + 1], chunk c is rows [qs[c], qs[c + 1])
    tiles: torch.Tensor | None = None  # "triton": the prefill kernel's work list (triton_attention.prefill_tiles)
    prompts: tuple[PromptChunk, ...] = ()  # "cpu" and "torch"
    lora: LoraRows | None = None  # each row's adapter slot, where the model serves adapters (lora_rows.py)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, sequences: int) -> torch.Tensor:
    kv_heads, _, _, dim = cache.shape
    return cache.index_select(1, blocks).view(kv_heads, sequences, -1, dim)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [n, heads, dim]; keys/values [kv_heads, n, tokens, dim] -> [n, heads, dim]."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[0]
    grouped = q.view(n, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, n, group, dim]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(n, heads, dim)


def _prompt(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [rows, heads, dim]; keys/values [kv_heads, 1, tokens, dim] -> [rows, heads, dim]."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # [kv_heads, 1, group * rows, dim]: row g * rows + i is query row i of head g of the group
    folded = q.view(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, 1, group * rows, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask.repeat(1, 1, group, 1), scale=scale)
    return out.view(kv_heads, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, heads, dim)


def attend(paged: PagedBatch, layer: int, q, k, v, scaling: float) -> torch.Tensor:
    """Store a layer's new keys and values, then attend: q [rows, heads, dim], k/v [rows, kv_heads, dim] (views
    of any strides) -> [rows, heads, dim]."""
    key_cache, value_cache = paged.kv[layer]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if paged.kernels == "triton":
        _triton_attention(paged, q, k, v, key_cache, value_cache, out, scaling)
        return out
    kv_heads, _, _, dim = key_cache.shape
    key_cache.view(kv_heads, -1, dim)[:, paged.slots] = k.transpose(0, 1)
    value_cache.view(kv_heads, -1, dim)[:, paged.slots] = v.transpose(0, 1)
    decodes = paged.decodes
    if decodes and paged.kernels == "cpu":
        queries = q[:decodes].contiguous()
        tables, lengths = paged.block_tables[:decodes], paged.lengths[:decodes]
        out[:decodes] = decode_kernel().paged_decode(queries, key_cache, value_cache, tables, lengths, scaling)
    elif decodes:
        tables = paged.block_tables[:decodes]
        keys = _gather(key_cache, tables.reshape(-1), decodes)
        values = _gather(value_cache, tables.reshape(-1), decodes)
        visible = torch.arange(keys.shape[2], device=q.device).unsqueeze(0) < paged.lengths[:decodes].unsqueeze(1)
        out[:decodes] = _decode(q[:decodes], keys, values, visible[None, :, None, :], scaling)
    for chunk in paged.prompts:
        rows = slice(chunk.start, chunk.end)
        if chunk.blocks is None:  # a whole new prompt (or its first chunk): nothing cached to read
            heads_first = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, rows, dim]
            attended = F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=scaling, enable_gqa=True)
            out[rows] = attended[0].transpose(0, 1)
            continue
        keys = _gather(key_cache, chunk.blocks, 1)
        values = _gather(value_cache, chunk.blocks, 1)
        out[rows] = _prompt(q[rows], keys, values, chunk.mask, scaling)
    return out


def _triton_attention(paged: PagedBatch, q, k, v, key_cache, value_cache, out, scaling) -> None:
    from workers.engine import triton_attention

    triton_attention.store_kv(k, v, key_cache, value_cache, paged.slots)
    decodes = paged.decodes
    if decodes:
        tables, lengths = paged.block_tables[:decodes], paged.lengths[:decodes]
        triton_attention.decode_attention(
            q[:decodes], key_cache, value_cache, tables, lengths, scaling, out[:decodes], paged.splits
        )
    if paged.tiles is not None:
        triton_attention.prefill_attention(
            q,
            key_cache,
            value_cache,
            paged.block_tables[decodes:],
            paged.lengths[decodes:],
            paged.query_starts,
            paged.tiles,
            scaling,
            out,
        )
