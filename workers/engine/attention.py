"""Attention over the paged KV cache, plugged into transformers' attention interface.

The model runner packs a step's tokens from every sequence into one row and
calls the Hugging Face model as usual; transformers computes embeddings,
rotary positions, projections and MLPs, and hands each layer's query, key and
value to `paged_attention`, which
1. writes the new keys and values into their sequences' cache slots, then
2. attends, per sequence, to everything that sequence has cached:
   - sequences decoding one token attend together, in a few groups of
     similar lengths: each group's blocks are gathered into one padded batch,
     with a mask for the padding;
   - each prompt chunk attends alone, causally, to its prefix and itself.

On CPUs, decoding sequences attend through a small C++ kernel
(paged_decode.cpp) that reads each sequence's keys and values in place,
twice as fast as gathering them first; where it cannot be built, and on
GPUs, the gather below is used.

The cache is laid out [kv_heads, blocks, block_size, dim] so that gathering a
batch's blocks along dim 1 yields keys [kv_heads, sequences, tokens, dim]
that are contiguous: scaled_dot_product_attention is three times slower on
strided keys. Query heads that share a KV head (grouped-query attention) are
folded next to the query rows, so keys and values are never repeated.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

IMPLEMENTATION = "tokenrelay_paged"
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
        return load(
            name=name,
            sources=[str(_KERNEL_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-ffast-math"],
            build_directory=str(build) if build else None,
        )
    except Exception as error:  # no compiler, no ninja: the PyTorch path still works
        log.warning("decode_kernel_unavailable", error=str(error)[:500])
        return None


@dataclass(frozen=True)
class PromptChunk:
    start: int  # rows of the packed batch
    end: int
    # None for a chunk that starts its sequence: it attends to itself alone, causally, from this step's
    # keys and values. Else the sequence's block ids and what each query row sees of them,
    # [1, 1, end - start, len(blocks) * block_size].
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences decoding one token each, attended to together."""

    rows: torch.Tensor  # [sequences]: their rows in the packed batch
    tables: torch.Tensor  # [sequences, max blocks]: their block ids, padded with block 0
    lengths: torch.Tensor  # [sequences]: their cached tokens, this step's included
    mask: torch.Tensor | None  # [1, sequences, 1, max blocks * block_size]: False on the padding (gather path)


@dataclass(frozen=True)
class PagedBatch:
    """Where a step's tokens go in the cache, and what each attends to; shared by all layers."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), [kv_heads, blocks, block_size, dim]
    slots: torch.Tensor  # [tokens]: the cache slot (block * block_size + offset) of each packed token
    decodes: list[DecodeGroup]
    prompts: list[PromptChunk]


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


def paged_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, paged=None, **kwargs):
    """transformers' attention signature: query [1, heads, tokens, dim], key/value [1, kv_heads, tokens, dim]."""
    key_cache, value_cache = paged.kv[module.layer_idx]
    kv_heads, _, _, dim = key_cache.shape
    key_cache.view(kv_heads, -1, dim)[:, paged.slots] = key[0]
    value_cache.view(kv_heads, -1, dim)[:, paged.slots] = value[0]

    q = query[0].transpose(0, 1)  # [tokens, heads, dim]
    out = torch.empty_like(q)
    kernel = decode_kernel() if q.device.type == "cpu" else None
    for group in paged.decodes:
        if kernel is not None:
            queries = q[group.rows].contiguous()
            out[group.rows] = kernel.paged_decode(queries, key_cache, value_cache, group.tables, group.lengths, scaling)
            continue
        n = group.rows.shape[0]
        keys = _gather(key_cache, group.tables.view(-1), n)
        values = _gather(value_cache, group.tables.view(-1), n)
        out[group.rows] = _decode(q[group.rows], keys, values, group.mask, scaling)
    for chunk in paged.prompts:
        rows = slice(chunk.start, chunk.end)
        if chunk.blocks is None:  # a whole new prompt (or its first chunk): nothing cached to read
            attended = F.scaled_dot_product_attention(
                query[:, :, rows], key[:, :, rows], value[:, :, rows], is_causal=True, scale=scaling, enable_gqa=True
            )
            out[rows] = attended[0].transpose(0, 1)
            continue
        keys = _gather(key_cache, chunk.blocks, 1)
        values = _gather(value_cache, chunk.blocks, 1)
        out[rows] = _prompt(q[rows], keys, values, chunk.mask, scaling)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """paged_attention builds its own masks; the model must not build a [tokens, tokens] one."""
    return None


AttentionInterface.register(IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
