"""The sampler's noise on GPUs: one Triton launch for every sampling row of a step.

Token j of a row gets Exp(1) noise from Philox keyed by the row's noise seed
(from the request's seed and the token's index) and counted by j, so a row's
noise depends on nothing else in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernel_launch import KernelLaunch

_BLOCK = 1024


@triton.jit
def _noise_kernel(seeds, out, vocab, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = tl.rand(tl.load(seeds + row), tokens)  # [0, 1): a 0 gives infinite noise, a token never drawn
    tl.store(out + row * stride_out + tokens, -tl.log(uniform), mask=tokens < vocab)


def noise_launch(seeds: torch.Tensor, out: torch.Tensor) -> KernelLaunch:
    """The noise kernel's KernelLaunch: out [rows, vocab] float32, a row per seed."""
    rows, vocab = out.shape
    return KernelLaunch(
        _noise_kernel, (rows, triton.cdiv(vocab, _BLOCK)), (seeds, out, vocab, out.stride(0)), dict(BLOCK=_BLOCK)
    )


def exponential_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] (float32) for rows of these int64 noise seeds."""
    out = torch.empty((seeds.shape[0], vocab), dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        noise_launch(seeds, out)()
    return out
