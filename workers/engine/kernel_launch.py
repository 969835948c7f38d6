"""A Triton kernel launch as data: the engine runs it, the compile check compiles exactly it.

Each launch function of triton_attention.py, triton_sampling.py,
triton_layers.py and triton_lora.py computes the KernelLaunch of its kernel (grid, arguments,
constexprs, warps) from the tensors it is given, and the engine calls it. `tokenrelay bench kernels`
(tokenrelay/bench/kernel_compile.py) calls the same functions on meta
tensors laid out as a model's and compiles what they return for an H200
ahead of time, so the tile sizes and warps it checks are the ones the engine
launches, never a copy of them. The precision the kernels compute in is one
rule for all of them (compute_dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton.language as tl

_CONSTEXPR = {torch.float32: tl.float32, torch.float64: tl.float64}


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a @triton.jit function (under TRITON_INTERPRET=1, Triton's interpreted stand-in)
    grid: tuple[int, ...]
    args: tuple  # the kernel's tensors and numbers, in its order, up to its constexprs
    constexprs: dict[str, Any]
    num_warps: int = 4  # Triton's default

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a kernel computes and accumulates in for a model of `dtype`: float32, or float64 for a
    float64 model, as torch computes one on the CPU (the exactness tests hold a float64 model to 1e-9 of
    transformers', which float32 arithmetic would miss by 1e-6)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_constexpr(dtype: torch.dtype) -> tl.dtype:
    """compute_dtype(dtype) as the tl.dtype that a kernel's constexpr takes."""
    return _CONSTEXPR[compute_dtype(dtype)]
