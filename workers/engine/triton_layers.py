"""The small fused operations of a decoder layer in Triton, for GPUs: one launch each.

In torch (workers/engine/models/ops.py, these kernels' reference) RMSNorm
after the residual add, SiLU-and-multiply and rotary are six to ten small
kernels each, every one a round trip of the activations through memory; here
each is one launch that reads its inputs once and writes its outputs once,
computing in float32 (float64 for a float64 model, as torch and transformers
do: the exactness tests hold a float64 model to 1e-9 of transformers', which
float32 arithmetic in the residual stream would miss by 1e-6). They run inside the decode
steps' CUDA graphs too: no host syncs, and nothing allocated but outputs of
the inputs' shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernel_launch import KernelLaunch, compute_constexpr

_SILU_BLOCK = 1024  # elements of a row per SiLU-and-multiply program: 8 a thread at 4 warps


@triton.jit
def _add_rms_norm_kernel(
    x,
    residual,
    weight,
    normed,
    summed,
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    total = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # rounded to the model's dtype, as torch's sum is, before it is normed
        added = total.to(COMPUTE) + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(COMPUTE)
        total = added.to(x.dtype.element_ty)
        tl.store(summed + row * HIDDEN + cols, total, mask=mask)
    wide = total.to(tl.float32)  # the norm itself is float32 in every dtype, as transformers computes it
    scaled = wide * tl.rsqrt(tl.sum(wide * wide, axis=0) / HIDDEN + eps)
    # transformers rounds the normed row to the model's dtype before the weight multiplies it
    out = scaled.to(x.dtype.element_ty).to(COMPUTE) * tl.load(weight + cols, mask=mask, other=0.0).to(COMPUTE)
    tl.store(normed + row * HIDDEN + cols, out.to(normed.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(COMPUTE)
    up = tl.load(x + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0).to(COMPUTE)
    tl.store(out + row * INTERMEDIATE + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(
    x,
    stride_h,
    cos,
    sin,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """Rotate one row's heads [HEADS, 2 * HALF] at x in place by cos, sin [1, BLOCK_HALF] (of dtype COMPUTE)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < HEADS) & (i < HALF)
    first = x + h * stride_h + i
    x1 = tl.load(first, mask=mask, other=0.0).to(COMPUTE)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(COMPUTE)
    tl.store(first, (x1 * cos - x2 * sin).to(x.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q,
    k,
    positions,
    cos,
    sin,
    stride_qr,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_cos,
    stride_sin,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions + row)
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos + position * stride_cos + i, mask=i < HALF, other=0.0).to(COMPUTE)[None, :]
    s = tl.load(sin + position * stride_sin + i, mask=i < HALF, other=0.0).to(COMPUTE)[None, :]
    _rotate(q + row * stride_qr, stride_qh, c, s, HEADS, BLOCK_H, HALF, BLOCK_HALF, COMPUTE)
    _rotate(k + row * stride_kr, stride_kh, c, s, KV_HEADS, BLOCK_KV, HALF, BLOCK_HALF, COMPUTE)


def _warps(elements: int) -> int:
    """Warps for a program of `elements` floats held at once: about 16 a thread, from 1 warp up to 16. A row
    of RMSNorm stays in registers, no loop over chunks: at hidden 8192 (16 warps) it compiled for sm_90 to 32
    registers, at 16384 to 64, without spills."""
    return min(16, max(1, elements // 512))


def add_rms_norm_launch(x, residual, weight, eps: float, normed, summed) -> KernelLaunch:
    """The RMSNorm kernel's KernelLaunch (see add_rms_norm): a program per row, the whole row in registers."""
    rows, hidden = x.shape
    has_residual = residual is not None
    block = triton.next_power_of_2(hidden)
    return KernelLaunch(
        _add_rms_norm_kernel,
        (rows,),
        (x, residual if has_residual else x, weight, normed, summed, x.stride(0))
        + ((residual if has_residual else x).stride(0), eps),
        dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual, COMPUTE=compute_constexpr(x.dtype)),
        num_warps=_warps(block),
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), x [rows, hidden]; without a residual the sum is x itself."""
    normed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    if x.shape[0]:
        add_rms_norm_launch(x, residual, weight, eps, normed, summed)()
    return normed, summed


def silu_and_mul_launch(x, out) -> KernelLaunch:
    """The SiLU-and-multiply kernel's KernelLaunch (see silu_and_mul): programs of rows x blocks of a row."""
    rows, intermediate = out.shape
    return KernelLaunch(
        _silu_and_mul_kernel,
        (rows, triton.cdiv(intermediate, _SILU_BLOCK)),
        (x, out, x.stride(0)),
        dict(INTERMEDIATE=intermediate, BLOCK=_SILU_BLOCK, COMPUTE=compute_constexpr(x.dtype)),
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up [rows, intermediate] of x [rows, 2 * intermediate], the fused projection's [gate | up]."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        silu_and_mul_launch(x, out)()
    return out


def rotary_launch(q, k, positions, cos, sin) -> KernelLaunch:
    """The rotary kernel's KernelLaunch (see apply_rotary): a program per row, for all its q and k heads."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    block_h, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(dim // 2)
    return KernelLaunch(
        _rotary_kernel,
        (rows,),
        (q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0)),
        dict(
            HEADS=heads,
            KV_HEADS=kv_heads,
            BLOCK_H=block_h,
            BLOCK_KV=triton.next_power_of_2(kv_heads),
            HALF=dim // 2,
            BLOCK_HALF=block_half,
            COMPUTE=compute_constexpr(q.dtype),
        ),
        num_warps=_warps(2 * block_h * block_half),
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [rows, heads, dim] and k [rows, kv_heads, dim] (any strides but the last) in place by their rows'
    positions, halves (i, i + dim / 2) paired as rotate_half pairs them; cos/sin [max positions, dim / 2] float32.
    Every position must index the tables (a CUDA graph's padding rows too). Returns q and k themselves."""
    if q.shape[0]:
        rotary_launch(q, k, positions, cos, sin)()
    return q, k
