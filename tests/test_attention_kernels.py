"""The paged attention kernels against plain attention over the same keys and values.

The Triton kernels run here under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), or compiled on a GPU with TOKENRELAY_TEST_DEVICE=cuda; their reference is the
gather + SDPA path that the "torch" kernels take.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.devices import TEST_DEVICE
from workers.engine.attention import _decode, _gather, _prompt, decode_kernel
from workers.engine.output_head import OutputHead


def _paged(kv_heads: int, dim: int, lengths: list[int], block_size: int, dtype: torch.dtype, device="cpu"):
    """A shuffled cache with unused blocks between the sequences' own, holding each sequence's keys and
    values; the block tables (padded with block 0) and the plain tensors they came from."""
    generator = torch.Generator().manual_seed(0)
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = 2 * sum(widths) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    keys = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator).to(dtype)  # garbage elsewhere
    values = torch.randn_like(keys)
    tables, plain = [], []
    for n, width in zip(lengths, widths, strict=True):
        table, order = order[:width], order[width + 1 :]  # a hole after each sequence's blocks
        k = torch.randn(kv_heads, width * block_size, dim, generator=generator).to(dtype)
        v = torch.randn(kv_heads, width * block_size, dim, generator=generator).to(dtype)
        keys[:, table] = k.view(kv_heads, width, block_size, dim)
        values[:, table] = v.view(kv_heads, width, block_size, dim)
        tables.append(table + [0] * (max(widths) - width))
        plain.append((k[:, :n], v[:, :n]))
    device = torch.device(device)
    return keys.to(device), values.to(device), torch.tensor(tables, device=device), plain


def _reference(q: torch.Tensor, plain, scale: float) -> torch.Tensor:
    out = []
    for query, (k, v) in zip(q, plain, strict=True):  # query [heads, dim]
        heads, kv_heads = query.shape[0], k.shape[0]
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        out.append(F.scaled_dot_product_attention(query.unsqueeze(1), k, v, scale=scale).squeeze(1))
    return torch.stack(out)


def _gathered_decode(q, keys, values, tables, lengths, scale):
    """The "torch" kernels' decode, in float64: the reference of the Triton kernels."""
    n = len(lengths)
    width = tables.shape[1] * keys.shape[2]
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[None, :, None, :]
    k, v = (_gather(cache.cpu().double(), tables.cpu().reshape(-1), n) for cache in (keys, values))
    return _decode(q.cpu().double(), k, v, mask, scale)


CASES = [(8, 4, 32), (8, 8, 64), (4, 1, 48), (16, 4, 128)]  # (heads, kv heads, dim); 48 is not specialised
# (heads, kv heads, dim, block size); the last with Llama-3-8B's group of 4 and head_dim 128
TRITON_CASES = [(8, 4, 32, 32), (16, 2, 64, 16), (4, 4, 48, 16), (8, 2, 128, 32)]
# The 16-bit kernels round p to the model's dtype for p·V, and the output, each once; the reference is float64
# over the same rounded inputs. Their tolerance is about 4 units of the dtype's rounding, 2**-11 for float16 and
# 2**-8 for bfloat16 (8 bits of significand): 8 times float16's. The worst error measured, as the least tolerance
# taken both ways, 20 seeds of q: float16 4.4e-4, bfloat16 3.3e-3 (the prefill's; the kernels run on the CPU under
# Triton's interpreter, made to multiply bfloat16 exactly and round to nearest even as a GPU does).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# bfloat16's tl.dot does not run under the interpreter: it is checked on a GPU only.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE.type == "cuda" else [])


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
    out = _gathered_decode(q, keys, values, tables, lengths, dim**-0.5)
    torch.testing.assert_close(out, _reference(q, plain, dim**-0.5))


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), TRITON_CASES)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_triton_decode_kernel_equals_the_gather_path(heads, kv_heads, dim, block_size, dtype, splits):
    from workers.engine.triton_attention import decode_attention

    lengths = [1, 5, block_size, block_size + 1, 0, 150]  # 0: a padding row of a CUDA graph
    keys, values, tables, _ = _paged(kv_heads, dim, lengths, block_size, dtype, TEST_DEVICE)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    out = torch.full_like(q, float("nan"), device=TEST_DEVICE)
    lengths_tensor = torch.tensor(lengths, device=TEST_DEVICE)
    decode_attention(q.to(TEST_DEVICE), keys, values, tables, lengths_tensor, dim**-0.5, out, splits)
    expected = _gathered_decode(q, keys, values, tables, lengths, dim**-0.5)
    expected[4] = 0  # a row that sees nothing comes out as zeros (and not NaN)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_store_kernel_writes_each_token_to_its_slot_and_padding_nowhere(dtype):
    from workers.engine.triton_attention import store_kv

    kv_heads, blocks, block_size, dim = 2, 5, 16, 48
    keys = torch.randn(kv_heads, blocks, block_size, dim).to(dtype)
    values = torch.randn_like(keys)
    # New tokens [tokens, kv_heads, dim], strided as transformers hands them over.
    new_keys = torch.randn(kv_heads, 4, dim).to(dtype).transpose(0, 1)
    new_values = torch.randn(kv_heads, 4, dim).to(dtype).transpose(0, 1)
    slots = [37, -1, 0, 79]
    expected_keys, expected_values = keys.clone(), values.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_keys[:, slot // block_size, slot % block_size] = new_keys[token]
            expected_values[:, slot // block_size, slot % block_size] = new_values[token]
    keys, values = keys.to(TEST_DEVICE), values.to(TEST_DEVICE)
    store_kv(
        new_keys.to(TEST_DEVICE), new_values.to(TEST_DEVICE), keys, values, torch.tensor(slots, device=TEST_DEVICE)
    )
    assert torch.equal(keys.cpu(), expected_keys) and torch.equal(values.cpu(), expected_values)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), TRITON_CASES)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_the_triton_prefill_kernel_equals_the_gather_path_over_prefix_cached_chunks(
    heads, kv_heads, dim, block_size, dtype
):
    from workers.engine.triton_attention import prefill_attention, prefill_rows, prefill_tiles

    # (tokens cached before the chunk, chunk length): a new prompt, a prefix-cached one, a one-token chunk,
    # one starting mid-block, a long one spanning several tiles.
    chunks = [(0, 7), (2 * block_size, 40), (block_size, 1), (5, 150), (0, block_size + 1)]
    lengths = [cached + new for cached, new in chunks]
    keys, values, tables, _ = _paged(kv_heads, dim, lengths, block_size, dtype)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, dim).to(dtype)
    expected = torch.empty(starts[-1], heads, dim, dtype=torch.float64)
    for index, (cached, new) in enumerate(chunks):
        rows = slice(starts[index], starts[index + 1])
        blocks = tables[index, : -(-lengths[index] // block_size)]
        k, v = (_gather(cache.double(), blocks, 1) for cache in (keys, values))
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(cached, cached + new)[:, None]
        expected[rows] = _prompt(q[rows].double(), k, v, mask[None, None], dim**-0.5)
    tiles = prefill_tiles(starts, prefill_rows(dtype, heads, kv_heads))
    out = torch.full_like(q, float("nan"), device=TEST_DEVICE)
    prefill_attention(
        *(t.to(TEST_DEVICE) for t in (q, keys, values, tables)),
        *(torch.tensor(x, device=TEST_DEVICE) for x in (lengths, starts, tiles)),
        dim**-0.5,
        out,
    )
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_decode_splits_fill_the_processors_only_where_the_batch_does_not():
    from workers.engine.triton_attention import decode_splits

    assert decode_splits(sequences=256, kv_heads=4, max_blocks=80, processors=132) == 1
    assert decode_splits(sequences=1, kv_heads=4, max_blocks=80, processors=132) == 20  # 4 blocks each at least
    assert decode_splits(sequences=8, kv_heads=4, max_blocks=80, processors=132) == 9
    assert decode_splits(sequences=1, kv_heads=8, max_blocks=3, processors=132) == 1  # too short to split


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


def test_the_fast_greedy_head_answers_none_for_a_nan_row_on_either_path():
    """A NaN row has no argmax (it is no candidate on the bfloat16 path): None, never the vocabulary size."""
    torch.manual_seed(1)
    projection = torch.nn.Linear(256, 32000, bias=False)
    head = OutputHead(projection, fast=True)
    hidden = torch.randn(4, 256)
    exact = F.linear(hidden, projection.weight).argmax(dim=-1).tolist()
    hidden[1] = float("nan")
    assert head.argmax(hidden) == [exact[0], None, *exact[2:]]
    flat = torch.zeros(4, 256)  # every token a candidate: the exact float32 path
    flat[1] = float("nan")
    assert head.argmax(flat) == [0, None, 0, 0]
