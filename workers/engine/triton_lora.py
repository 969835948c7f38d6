"""A step's LoRA products in Triton, for GPUs: every row's x·Aᵀ·Bᵀ under its own slot, in two launches.

A projection's pool (models/lora.py) holds A [slots, R, inputs] and B
[slots, outputs, R] of each device slot, taken here as views of any strides
(its first R ranks; B a transposed view where the pool stores Bᵀ). A step's
rows arrive grouped by slot as `order`, `starts` and `counts` (LoraRows),
device tensors built there with torch ops. As Punica's SGMV does, each
launch's programs take a tile of one slot's rows: the shrink computes
t = x·Aᵀ in float32 (float64 for a float64 model, which the exactness tests
run: kernel_launch.compute_dtype), the expand adds t·Bᵀ to y. The grids are
sized from the shapes alone, every slot given room for all the step's rows, and a program
past its slot's rows returns at once: no host sync, the same launches
whatever the step's mix of adapters, so that decode graphs capture them.
Rows outside every slot's range (the base model's) are never read or written.

A decode step has a few rows per slot, so few row tiles that one shrink
program per tile would stream a whole A [R, inputs] alone; the shrink splits
its inputs among programs, each storing its partial t, and the expand sums
them in a fixed order (the same bits every run, no atomics), rounds t to the
model's dtype once, as torch's x·Aᵀ is, and multiplies on tensor cores,
accumulating as the shrink does. float32 models' products are exact
("ieee"), not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernel_launch import KernelLaunch, compute_constexpr, compute_dtype

_BLOCK_M = 16  # rows of a slot per program: tl.dot's least, and a decode step has few rows per slot
_BLOCK_K = 64  # inputs per shrink step
# float64's: A's tile [32, R] in float32's bytes. At R 256 (sm_90) the shrink then takes float32's 136 KB of shared
# memory; 64 inputs took 272 KB, past an H100's 227 KB a program, and spilled 24 bytes of registers.
_BLOCK_K_FLOAT64 = 32
_BLOCK_N = 128  # outputs per expand program
_BLOCK_R = 64  # ranks per expand step: a fused QKV's 3 x 64 in three
_SHRINK_PROGRAMS = 264  # the shrink's busy programs wanted: two per processor of an H200 (132)
# A shrink program's inputs: at least this many (8 steps), so that its loads stream. For each output tile the
# expand reads every split's partial t of its rows (splits x R floats a row, from L2) beside B's R x 128.
_SPLIT_INPUTS = 512


@triton.jit
def _slot_rows(order, starts, counts, slot, tile, BLOCK_M: tl.constexpr):
    """The tile's positions in `order` [BLOCK_M], their rows, whether each is the slot's, and whether any is."""
    count = tl.load(counts + slot)
    first = tile * BLOCK_M
    offsets = first + tl.arange(0, BLOCK_M)
    in_slot = offsets < count
    positions = tl.load(starts + slot) + offsets
    rows = tl.load(order + positions, mask=in_slot, other=0)
    return positions, rows, in_slot, first < count


@triton.jit
def _shrink_kernel(
    x,
    a,
    order,
    starts,
    counts,
    partials,
    split_inputs,
    stride_x,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ps,
    INPUTS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    tile, split, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    positions, rows, in_slot, busy = _slot_rows(order, starts, counts, slot, tile, BLOCK_M)
    if not busy:
        return
    r = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    x_rows = x + rows[:, None] * stride_x
    ranks = r[None, :] < R
    a_ranks = a + slot * stride_as + r[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], ACC)
    first = split * split_inputs
    for start in range(first, tl.minimum(first + split_inputs, INPUTS), BLOCK_K):
        inputs = start + k
        x_tile = tl.load(x_rows + inputs[None, :], mask=in_slot[:, None] & (inputs[None, :] < INPUTS), other=0.0)
        a_tile = tl.load(a_ranks + inputs[:, None] * stride_ak, mask=(inputs[:, None] < INPUTS) & ranks, other=0.0)
        acc += tl.dot(x_tile, a_tile, input_precision=PRECISION)
    target = partials + split * stride_ps + positions[:, None] * R + r[None, :]
    tl.store(target, acc, mask=in_slot[:, None] & ranks)


@triton.jit
def _expand_kernel(
    y,
    partials,
    b,
    order,
    starts,
    counts,
    splits,
    stride_y,
    stride_ps,
    stride_bs,
    stride_bo,
    stride_br,
    OUTPUTS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    tile, out_tile, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    positions, rows, in_slot, busy = _slot_rows(order, starts, counts, slot, tile, BLOCK_M)
    if not busy:
        return
    n = out_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    b_outputs = b + slot * stride_bs + n[None, :] * stride_bo
    acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    for first in range(0, R, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        t_mask = in_slot[:, None] & (r[None, :] < R)
        t_tile = partials + positions[:, None] * R + r[None, :]
        t = tl.zeros([BLOCK_M, BLOCK_R], ACC)
        for split in range(splits):
            t += tl.load(t_tile + split * stride_ps, mask=t_mask, other=0.0)
        b_tile = tl.load(b_outputs + r[:, None] * stride_br, mask=(r[:, None] < R) & (n[None, :] < OUTPUTS), other=0.0)
        acc += tl.dot(t.to(b.dtype.element_ty), b_tile, input_precision=PRECISION)
    target = y + rows[:, None] * stride_y + n[None, :]
    y_mask = in_slot[:, None] & (n[None, :] < OUTPUTS)
    added = tl.load(target, mask=y_mask, other=0.0).to(ACC) + acc
    tl.store(target, added.to(y.dtype.element_ty), mask=y_mask)


def _precision(dtype: torch.dtype) -> str:
    """float32 products exact, not rounded to TF32; 16-bit ones take the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink_split_inputs(rows: int, slots: int, inputs: int) -> int:
    """Inputs per shrink program (a multiple of its step): enough splits that the busy row tiles, at most one
    per 16 rows plus one per slot, make about _SHRINK_PROGRAMS programs, none shorter than _SPLIT_INPUTS."""
    busy_tiles = min(triton.cdiv(rows, _BLOCK_M) * slots, triton.cdiv(rows, _BLOCK_M) + slots)
    splits = max(1, min(triton.cdiv(_SHRINK_PROGRAMS, busy_tiles), triton.cdiv(inputs, _SPLIT_INPUTS)))
    return triton.cdiv(triton.cdiv(inputs, splits), _BLOCK_K) * _BLOCK_K


def lora_launches(y, x, a, b, order, starts, counts) -> list[KernelLaunch]:
    """The shrink kernel's KernelLaunch, then the expand's (see add_lora), their partial t [splits, rows, R]
    (float32, float64 for float64 inputs) allocated here."""
    rows, inputs = x.shape
    slots, rank, _ = a.shape
    outputs = b.shape[1]
    split_inputs = shrink_split_inputs(rows, slots, inputs)
    splits = triton.cdiv(inputs, split_inputs)
    partials = torch.empty((splits, rows, rank), dtype=compute_dtype(x.dtype), device=x.device)
    row_tiles = triton.cdiv(rows, _BLOCK_M)
    block_r = max(16, triton.next_power_of_2(rank))  # tl.dot: at least 16 each way
    shrink = KernelLaunch(
        _shrink_kernel,
        (row_tiles, splits, slots),
        (x, a, order, starts, counts, partials, split_inputs, x.stride(0), *a.stride(), partials.stride(0)),
        dict(
            INPUTS=inputs,
            R=rank,
            BLOCK_M=_BLOCK_M,
            BLOCK_R=block_r,
            BLOCK_K=_BLOCK_K_FLOAT64 if x.dtype == torch.float64 else _BLOCK_K,
            PRECISION=_precision(x.dtype),
            ACC=compute_constexpr(x.dtype),
        ),
    )
    expand = KernelLaunch(
        _expand_kernel,
        (row_tiles, triton.cdiv(outputs, _BLOCK_N), slots),
        (y, partials, b, order, starts, counts, splits, y.stride(0), partials.stride(0), *b.stride()),
        dict(
            OUTPUTS=outputs,
            R=rank,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=_BLOCK_N,
            BLOCK_R=min(_BLOCK_R, block_r),
            PRECISION=_precision(x.dtype),
            ACC=compute_constexpr(x.dtype),
        ),
    )
    return [shrink, expand]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """y[r] += (x[r] @ a[s]^T) @ b[s]^T for every row r of slot s, in place.

    x [rows, inputs], y [rows, outputs] (rows of any stride, columns contiguous), a [slots, R, inputs] and
    b [slots, outputs, R] of any strides (a pool's first R ranks, B a transposed view where it stores Bᵀ),
    all float16, bfloat16, float32 or float64 alike. order, starts, counts: int64 device tensors [rows],
    [slots], [slots]: slot s's rows are order[starts[s] : starts[s] + counts[s]]; a row in no slot's range
    is left exactly as it is."""
    if x.shape[0]:
        for launch in lora_launches(y, x, a, b, order, starts, counts):
            launch()
