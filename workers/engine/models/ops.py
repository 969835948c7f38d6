"""The small fused operations of a decoder layer: RMSNorm after the residual add, SiLU-and-multiply, rotary.

Each is written once in torch, exactly as transformers' Llama computes it
(RMSNorm in float32 whatever the model's dtype, rotary in the model's dtype
from float32 angles), so that the native models equal transformers' to the
last bit on the CPU. On a GPU the same operations are Triton kernels
(workers/engine/triton_layers.py), one launch each instead of the six to ten
small kernels these expressions are, and checked against these.

A float64 model (the exactness tests') runs the kernels in float64, except
RMSNorm's statistic: transformers computes it in float32, so its value
depends on the order torch's own reduction sums in and on the device's
rsqrt, which no kernel of ours reproduces bit for bit (the Triton norm put
log-probabilities 5.8e-7 from transformers', where the tests hold them to
1e-9). On every device that norm is torch's, the very kernels transformers'
model runs there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def on_triton(x: torch.Tensor) -> bool:
    """Whether x's operations run as the Triton kernels: on a GPU (a test may ask for them on the CPU, interpreted)."""
    return x.is_cuda


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without a residual, of x alone. x [rows, hidden]."""
    if on_triton(x) and x.dtype != torch.float64:
        from workers.engine import triton_layers

        return triton_layers.add_rms_norm(x, residual, weight, eps)
    return torch_add_rms_norm(x, residual, weight, eps)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    wide = summed.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where x [rows, 2 * intermediate] is the fused projection's [gate | up]."""
    if on_triton(x):
        from workers.engine import triton_layers

        return triton_layers.silu_and_mul(x)
    return torch_silu_and_mul(x)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [rows, heads, dim] and k [rows, kv_heads, dim] (views of the QKV projection) by their rows'
    positions, halves (i, i + dim / 2) paired as in transformers' rotate_half; `cos`/`sin` [max positions,
    dim / 2], float32. The result may be q and k themselves, rotated in place (the Triton kernel does that)."""
    if on_triton(q):
        from workers.engine import triton_layers

        return triton_layers.apply_rotary(q, k, positions, cos, sin)
    return torch_apply_rotary(q, k, positions, cos, sin)


def torch_apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half_cos, half_sin = cos[positions], sin[positions]  # [rows, dim / 2]
    row_cos = torch.cat((half_cos, half_cos), dim=-1).to(q.dtype).unsqueeze(1)  # [rows, 1, dim]
    row_sin = torch.cat((half_sin, half_sin), dim=-1).to(q.dtype).unsqueeze(1)
    return _rotated(q, row_cos, row_sin), _rotated(k, row_cos, row_sin)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
