"""Attention over the paged KV cache in Triton, for GPUs: every kernel reads the cache in place.

The cache is the engine's: per layer, keys and values [kv_heads, blocks,
block_size, dim], so one (KV head, block) tile is contiguous. Each sequence
finds its blocks through a row of `block_tables`; `lengths` says how many of
its tokens are cached once this step's are stored. Three kinds of work:
- store: this step's keys and values go to their slots (slot -1, a padding
  row of a CUDA graph, goes nowhere);
- decode: one query token per sequence; a program per (sequence, KV head)
  serves all the query heads that share that KV head, so each key and value
  is loaded once, with an online softmax. When there are too few sequences to
  fill the GPU, each sequence's blocks are split among programs and a second
  kernel merges their partial results;
- prefill: prompt chunks of any length in one launch (`query_starts` is
  cu_seqlens_q over the packed rows), each query attending causally to its
  sequence's cached prefix and to the chunk itself, all read through the block
  table (the store runs first).
Triton compiles a kernel once per key: each pointer's 16-byte alignment, each
integer's being 1 or a multiple of 16, the constexprs; a key first met
compiles within that step (0.2-0.4 s). The model runner packs every part of a
step 16 bytes aligned (model_runner.PackedStep). What still varies from step
to step is left unspecialised (do_not_specialize,
do_not_specialize_on_alignment): the table width and the decode split, and
the prefill's block tables and lengths, which start after the decoding rows'.
Each only offsets a scalar load or bounds a loop, where a known alignment or
divisibility gains nothing.
Scores and softmax state are float32 (float64 for a float64 model, which the
exactness tests use); float32 matrix products are exact ("ieee"), not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernel_launch import KernelLaunch, compute_constexpr, compute_dtype

# A decode program should have at least this many blocks of its sequence to
# read, or the merge costs more than the split gains.
_MIN_BLOCKS_PER_SPLIT = 4
# A prefill program's tile: its query rows (tokens x heads of a group), by dtype, and its warps, as many
# as keep each thread's share of the [rows, head_dim] float32 accumulator within the dtype's budget
# (tokenrelay bench kernels measures them). 16-bit products run on tensor cores: 64 floats a thread, 128 rows
# (Llama-3-8B's head_dim 128 took 255 registers at 4 warps and spilled; it takes 149 at 8). float32's exact
# ("ieee") products run on the FMA units, whose operands need registers too: 16 a thread, 32 rows (128 rows
# spilled kilobytes). float64 runs without tl.dot and only in the exactness tests: small broadcast products,
# Triton's default 4 warps.
_PREFILL_ROWS = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 32, torch.float64: 32}
_PREFILL_FLOATS_PER_THREAD = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 16}


@triton.jit
def _store_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    d = tl.arange(0, BLOCK_D)
    mask = d < tl.where(slot >= 0, DIM, 0)  # not (d < DIM) & (slot >= 0): Triton's interpreter mistypes it
    block = slot // BLOCK_SIZE
    base = ((head.to(tl.int64) * num_blocks + block) * BLOCK_SIZE + slot % BLOCK_SIZE) * DIM
    k = tl.load(key + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(key_cache + base + d, k, mask=mask)
    tl.store(value_cache + base + d, v, mask=mask)


@triton.jit
def _scores(q, k, scale, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """q [rows, dim] . k [tokens, dim]^T -> [rows, tokens]."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    return s * scale


@triton.jit
def _weighted(p, v, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """p [rows, tokens] . v [tokens, dim] -> [rows, dim]."""
    if USE_DOT:
        out = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    else:
        out = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return out


@triton.jit(do_not_specialize=["splits", "stride_table"])
def _decode_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    lengths,
    out,
    partial_acc,
    partial_max,
    partial_sum,
    scale,
    num_blocks,
    splits,
    stride_qt,
    stride_qh,
    stride_table,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths + seq)
    used = tl.cdiv(length, BLOCK_SIZE)
    per_split = tl.cdiv(used, splits)
    first = split * per_split
    last = tl.minimum(first + per_split, used)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    rows_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
    q = tl.load(query + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=rows_mask, other=0.0)
    top = tl.full([BLOCK_G], float("-inf"), ACC)
    total = tl.zeros([BLOCK_G], ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC)
    head_base = kv_head.to(tl.int64) * num_blocks
    for index in range(first, last):
        block = tl.load(block_tables + seq * stride_table + index)
        positions = index * BLOCK_SIZE + t
        offsets = ((head_base + block) * BLOCK_SIZE + t[:, None]) * DIM + d[None, :]
        kv_mask = (positions[:, None] < length) & (d[None, :] < DIM)
        k = tl.load(key_cache + offsets, mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, USE_DOT, PRECISION).to(ACC)
        s = tl.where((positions < length)[None, :], s, float("-inf"))
        # Every block in [first, last) holds a token: the new maximum is finite.
        new_top = tl.maximum(top, tl.max(s, axis=1))
        alpha = tl.exp(top - new_top)
        p = tl.exp(s - new_top[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache + offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, USE_DOT, PRECISION).to(ACC)
        top = new_top

    if PARTIAL:  # unnormalised, with its own maximum: _merge_kernel weighs the splits
        heads_total = tl.num_programs(1) * GROUP
        at = (seq * heads_total + heads) * splits + split
        tl.store(partial_max + at, top, mask=g < GROUP)
        tl.store(partial_sum + at, total, mask=g < GROUP)
        tl.store(partial_acc + at[:, None] * DIM + d[None, :], acc, mask=rows_mask)
    else:  # a padding row (length 0) has total 0: it writes zeros
        result = acc / tl.where(total == 0, 1.0, total)[:, None]
        target = out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(target, result.to(out.dtype.element_ty), mask=rows_mask)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(
    partial_acc,
    partial_max,
    partial_sum,
    out,
    splits,
    stride_ot,
    stride_oh,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    at = (seq * tl.num_programs(1) + head) * splits + s
    present = s < splits
    tops = tl.load(partial_max + at, mask=present, other=float("-inf"))
    sums = tl.load(partial_sum + at, mask=present, other=0.0)
    top = tl.max(tops, axis=0)
    weights = tl.exp(tops - tl.where(top == float("-inf"), 0.0, top))  # an empty split weighs 0
    total = tl.sum(weights * sums, axis=0)
    acc = tl.load(partial_acc + at[:, None] * DIM + d[None, :], mask=present[:, None] & (d[None, :] < DIM), other=0.0)
    result = tl.sum(acc * weights[:, None], axis=0) / tl.where(total == 0, 1.0, total)
    tl.store(out + seq * stride_ot + head * stride_oh + d, result.to(out.dtype.element_ty), mask=d < DIM)


@triton.jit(do_not_specialize=["stride_table"], do_not_specialize_on_alignment=["block_tables", "lengths"])
def _prefill_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    lengths,
    query_starts,
    tiles,
    out,
    scale,
    num_blocks,
    stride_qt,
    stride_qh,
    stride_table,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(tiles + 2 * tile)
    first_row = tl.load(tiles + 2 * tile + 1)
    chunk_end = tl.load(query_starts + chunk + 1)
    length = tl.load(lengths + chunk)  # the chunk's last row is the token at position length - 1

    # Row r of the tile is query token r // BLOCK_G of the tile, head r % BLOCK_G of the group.
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    g = r % BLOCK_G
    rows = first_row + r // BLOCK_G
    valid = (rows < chunk_end) & (g < GROUP)
    positions = length - (chunk_end - rows)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    rows_mask = valid[:, None] & (d[None, :] < DIM)
    q = tl.load(query + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=rows_mask, other=0.0)
    top = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), ACC)
    total = tl.zeros([BLOCK_Q * BLOCK_G], ACC)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], ACC)
    head_base = kv_head.to(tl.int64) * num_blocks
    last_position = length - (chunk_end - tl.minimum(first_row + BLOCK_Q, chunk_end)) - 1
    for index in range(0, last_position // BLOCK_SIZE + 1):  # causal: no block past the tile's last query
        block = tl.load(block_tables + chunk * stride_table + index)
        key_positions = index * BLOCK_SIZE + t
        offsets = ((head_base + block) * BLOCK_SIZE + t[:, None]) * DIM + d[None, :]
        kv_mask = (key_positions[:, None] < length) & (d[None, :] < DIM)
        k = tl.load(key_cache + offsets, mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, USE_DOT, PRECISION).to(ACC)
        s = tl.where(key_positions[None, :] <= positions[:, None], s, float("-inf"))
        # Rows past the chunk, or heads past the group, see nothing: keep their state at zero, not NaN.
        new_top = tl.maximum(top, tl.max(s, axis=1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.exp(top - safe_top)
        p = tl.exp(s - safe_top[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache + offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, USE_DOT, PRECISION).to(ACC)
        top = new_top
    result = acc / tl.where(total == 0, 1.0, total)[:, None]
    target = out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(target, result.to(out.dtype.element_ty), mask=rows_mask)


def _precision(dtype: torch.dtype) -> str:
    """float32 products exact, not rounded to TF32; 16-bit ones take the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _use_dot(dtype: torch.dtype, block_size: int, dim: int) -> bool:
    """tl.dot takes 16-bit and 32-bit floats in tiles of at least 16 each way."""
    return dtype in (torch.float16, torch.bfloat16, torch.float32) and block_size >= 16 and dim >= 16


def store_launch(key, value, key_cache, value_cache, slots) -> KernelLaunch:
    """The store kernel's KernelLaunch (see store_kv)."""
    tokens, kv_heads, dim = key.shape
    _, num_blocks, block_size, _ = key_cache.shape
    return KernelLaunch(
        _store_kernel,
        (tokens, kv_heads),
        (key, value, key_cache, value_cache, slots, key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        + (num_blocks,),
        dict(BLOCK_SIZE=block_size, DIM=dim, BLOCK_D=triton.next_power_of_2(dim)),
    )


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots):
    """key/value [tokens, kv_heads, dim] (any strides but the last) into their slots of the caches."""
    store_launch(key, value, key_cache, value_cache, slots)()


def decode_splits(sequences: int, kv_heads: int, max_blocks: int, processors: int) -> int:
    """How many programs share each sequence's blocks, so that about two programs run per processor."""
    if sequences == 0 or sequences * kv_heads >= processors:
        return 1
    wanted = -(-2 * processors // (sequences * kv_heads))
    return max(1, min(wanted, max_blocks // _MIN_BLOCKS_PER_SPLIT))


def decode_launches(query, key_cache, value_cache, block_tables, lengths, scale: float, out, splits: int):
    """The decode kernel's KernelLaunch, then the merge kernel's if `splits` > 1 (their partial results in
    buffers allocated here)."""
    sequences, heads, dim = query.shape
    kv_heads, num_blocks, block_size, _ = key_cache.shape
    group = heads // kv_heads
    block_d = triton.next_power_of_2(dim)
    partial = splits > 1
    use_dot = _use_dot(query.dtype, block_size, dim)
    shape = (sequences, heads, splits) if partial else (1,)
    accumulator = compute_dtype(query.dtype)
    partial_max = torch.empty(shape, dtype=accumulator, device=query.device)
    partial_sum = torch.empty(shape, dtype=accumulator, device=query.device)
    partial_acc = torch.empty((*shape, dim) if partial else (1,), dtype=accumulator, device=query.device)
    decode = KernelLaunch(
        _decode_kernel,
        (sequences, kv_heads, splits),
        (query, key_cache, value_cache, block_tables, lengths, out, partial_acc, partial_max, partial_sum, scale)
        + (num_blocks, splits, query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(
            GROUP=group,
            BLOCK_G=max(16 if use_dot else 1, triton.next_power_of_2(group)),  # tl.dot: at least 16 rows
            BLOCK_SIZE=block_size,
            DIM=dim,
            BLOCK_D=block_d,
            PARTIAL=partial,
            USE_DOT=use_dot,
            PRECISION=_precision(query.dtype),
            ACC=compute_constexpr(query.dtype),
        ),
    )
    if not partial:
        return [decode]
    merge = KernelLaunch(
        _merge_kernel,
        (sequences, heads),
        (partial_acc, partial_max, partial_sum, out, splits, out.stride(0), out.stride(1)),
        dict(DIM=dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits)),
    )
    return [decode, merge]


def decode_attention(query, key_cache, value_cache, block_tables, lengths, scale: float, out, splits: int) -> None:
    """query/out [sequences, heads, dim]: one token per sequence, attending to its first `lengths` cached tokens."""
    for launch in decode_launches(query, key_cache, value_cache, block_tables, lengths, scale, out, splits):
        launch()


def prefill_rows(dtype: torch.dtype, heads: int, kv_heads: int) -> int:
    """Query tokens per prefill program: a tile is that many tokens times the padded group of heads."""
    return max(1, _PREFILL_ROWS[dtype] // triton.next_power_of_2(heads // kv_heads))


def _prefill_warps(dtype: torch.dtype, rows: int, block_d: int) -> int:
    """Warps of a prefill program of `rows` query rows (tokens x padded group) and head_dim padded to block_d."""
    if dtype not in _PREFILL_FLOATS_PER_THREAD:
        return 4
    return max(4, rows * block_d // (32 * _PREFILL_FLOATS_PER_THREAD[dtype]))


def prefill_tiles(query_starts: list[int], rows_per_tile: int) -> list[int]:
    """The prefill programs' work: (chunk, first row) of each tile of `rows_per_tile` query tokens, flattened."""
    tiles: list[int] = []
    for chunk, (start, end) in enumerate(zip(query_starts, query_starts[1:], strict=False)):
        for row in range(start, end, rows_per_tile):
            tiles += (chunk, row)
    return tiles


def prefill_launch(
    query, key_cache, value_cache, block_tables, lengths, query_starts, tiles, scale: float, out
) -> KernelLaunch:
    """The prefill kernel's KernelLaunch (see prefill_attention)."""
    _, heads, dim = query.shape
    kv_heads, num_blocks, block_size, _ = key_cache.shape
    group = heads // kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = prefill_rows(query.dtype, heads, kv_heads)
    block_d = triton.next_power_of_2(dim)
    return KernelLaunch(
        _prefill_kernel,
        (tiles.shape[0] // 2, kv_heads),
        (query, key_cache, value_cache, block_tables, lengths, query_starts, tiles, out, scale, num_blocks)
        + (query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(
            GROUP=group,
            BLOCK_G=block_g,
            BLOCK_Q=block_q,
            BLOCK_SIZE=block_size,
            DIM=dim,
            BLOCK_D=block_d,
            USE_DOT=_use_dot(query.dtype, block_size, dim),
            PRECISION=_precision(query.dtype),
            ACC=compute_constexpr(query.dtype),
        ),
        num_warps=_prefill_warps(query.dtype, block_q * block_g, block_d),
    )


def prefill_attention(
    query, key_cache, value_cache, block_tables, lengths, query_starts, tiles, scale: float, out
) -> None:
    """Prompt chunks: query/out rows query_starts[c]:query_starts[c + 1] are chunk c, whose last row is
    the token at position lengths[c] - 1; `tiles` from prefill_tiles."""
    prefill_launch(query, key_cache, value_cache, block_tables, lengths, query_starts, tiles, scale, out)()
