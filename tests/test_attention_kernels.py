"""The paged attention paths against plain attention over the same keys and values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine.attention import _decode, _gather, decode_kernel
from workers.engine.output_head import OutputHead


def _paged(kv_heads: int, dim: int, lengths: list[int], block_size: int, dtype: torch.dtype):
    """A shuffled cache holding each sequence's keys and values, and the plain tensors they came from."""
    generator = torch.Generator().manual_seed(0)
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    keys = torch.zeros(kv_heads, num_blocks, block_size, dim, dtype=dtype)
    values = torch.zeros_like(keys)
    tables, plain = [], []
    for n, width in zip(lengths, widths, strict=True):
        table, order = order[:width], order[width:]
        k = torch.randn(kv_heads, width * block_size, dim, generator=generator, dtype=dtype)
        v = torch.randn(kv_heads, width * block_size, dim, generator=generator, dtype=dtype)
        keys[:, table] = k.view(kv_heads, width, block_size, dim)
        values[:, table] = v.view(kv_heads, width, block_size, dim)
        tables.append(table + [0] * (max(widths) - width))
        plain.append((k[:, :n], v[:, :n]))
    return keys, values, torch.tensor(tables), plain


def _reference(q: torch.Tensor, plain, scale: float) -> torch.Tensor:
    out = []
    for query, (k, v) in zip(q, plain, strict=True):  # query [heads, dim]
        heads, kv_heads = query.shape[0], k.shape[0]
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        out.append(F.scaled_dot_product_attention(query.unsqueeze(1), k, v, scale=scale).squeeze(1))
    return torch.stack(out)


CASES = [(8, 4, 32), (8, 8, 64), (4, 1, 48), (16, 4, 128)]  # (heads, kv heads, dim); 48 is not specialised


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_kernel_equals_plain_attention(heads, kv_heads, dim, dtype):
    kernel = decode_kernel()
    assert kernel is not None, "the C++ decode kernel did not build"
    lengths = [1, 5, 32, 33, 100, 257]
    keys, values, tables, plain = _paged(kv_heads, dim, lengths, 32, dtype)
    q = torch.randn(len(lengths), heads, dim, dtype=dtype)
    out = kernel.paged_decode(q, keys, values, tables, torch.tensor(lengths), dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, _reference(q, plain, dim**-0.5), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), CASES)
def test_the_gather_path_equals_plain_attention(heads, kv_heads, dim):
    lengths = [3, 40, 64, 150]
    keys, values, tables, plain = _paged(kv_heads, dim, lengths, 16, torch.float64)
    q = torch.randn(len(lengths), heads, dim, dtype=torch.float64)
    width = tables.shape[1]
    mask = (torch.arange(width * 16)[None, :] < torch.tensor(lengths)[:, None])[None, :, None, :]
    gathered_keys = _gather(keys, tables.view(-1), len(lengths))
    gathered_values = _gather(values, tables.view(-1), len(lengths))
    out = _decode(q, gathered_keys, gathered_values, mask, dim**-0.5)
    torch.testing.assert_close(out, _reference(q, plain, dim**-0.5))


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_the_fast_greedy_head_finds_the_exact_argmax(scale):
    torch.manual_seed(1)
    projection = torch.nn.Linear(256, 32000, bias=False)
    head = OutputHead(projection, fast=True)
    assert head.fast
    hidden = torch.randn(64, 256) * scale
    hidden[0] = 0  # a flat row: every logit is zero
    hidden[1, 1:] = 0  # an almost flat one
    exact = torch.nn.functional.linear(hidden, projection.weight).argmax(dim=-1).tolist()
    assert head.argmax(hidden) == exact
