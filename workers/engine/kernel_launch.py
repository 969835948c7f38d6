"""A Triton kernel launch as data: the engine runs it, the compile check compiles exactly it.

Each launch function of triton_attention.py, triton_sampling.py and
triton_layers.py computes the KernelLaunch of its kernel (grid, arguments,
constexprs, warps) from the tensors it is given, and the engine calls it. `tokenrelay bench kernels`
(tokenrelay/bench/kernel_compile.py) calls the same functions on meta
tensors laid out as a model's and compiles what they return for an H200
ahead of time, so the tile sizes and warps it checks are the ones the engine
launches, never a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a @triton.jit function (under TRITON_INTERPRET=1, Triton's interpreted stand-in)
    grid: tuple[int, ...]
    args: tuple  # the kernel's tensors and numbers, in its order, up to its constexprs
    constexprs: dict[str, Any]
    num_warps: int = 4  # Triton's default

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps)
