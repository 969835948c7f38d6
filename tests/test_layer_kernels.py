"""The decoder layer's Triton kernels (workers/engine/triton_layers.py) against their torch reference.

They run here under Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), or
compiled on a GPU with TOKENRELAY_TEST_DEVICE=cuda; the reference is workers/engine/models/ops.py's torch, on
the CPU. In float32 they agree to rounding. In float16 the kernels compute in float32 and round once, where
torch rounds some steps to float16 on the way (SiLU before the product, cos and sin and each product of the
rotation), so the two differ by a few of float16's ulps (2**-10 relative); RMSNorm's float16 results differ
by at most an ulp (the kernel sums the squares in another order) and a second ulp from the weight's product.
In float64 the kernels compute in float64, as torch does, and agree to 1e-12, but for RMSNorm's statistic:
float32 in transformers' arithmetic, its last bits depend on the order of the sum, so a float64 model's norm
stays torch's (models/ops.py), which the last test holds to transformers' log-probabilities.
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import TEST_DEVICE
from tests.test_engine import PROMPTS, Harness, _logprobs, _tokens
from workers.bundled import BUNDLED_MODEL
from workers.engine import triton_layers
from workers.engine.config import EngineConfig
from workers.engine.model_loader import load_model
from workers.engine.models import ops
from workers.engine.models.ops import torch_add_rms_norm, torch_apply_rotary, torch_silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.float64]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.float64: 1e-12}
FLOAT32_STATISTIC = 1e-6  # a float64 row normed by a float32 statistic summed in another order: float32's ulps


def _randn(*size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu(), expected, atol=tolerance, rtol=tolerance)


# (rows, hidden): 320 is not a power of two (a masked tile); 4096 is Llama-3-8B's, 8 warps
@pytest.mark.parametrize(("rows", "hidden"), [(1, 256), (7, 256), (7, 320), (1, 320), (7, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_torchs(rows, hidden, with_residual, dtype):
    x = _randn(rows, hidden, dtype=dtype, seed=0)
    residual = _randn(rows, hidden, dtype=dtype, seed=1) if with_residual else None
    weight = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight, 1e-6)
    on_device = x.to(TEST_DEVICE)
    normed, summed = triton_layers.add_rms_norm(
        on_device, None if residual is None else residual.to(TEST_DEVICE), weight.to(TEST_DEVICE), 1e-6
    )
    assert normed.dtype == dtype and normed.shape == (rows, hidden)
    if residual is None:
        assert summed is on_device
    torch.testing.assert_close(summed.cpu(), expected_summed, atol=0, rtol=0)  # one rounding of the same sum
    if dtype == torch.float64:
        torch.testing.assert_close(normed.cpu(), expected_normed, atol=FLOAT32_STATISTIC, rtol=FLOAT32_STATISTIC)
    else:
        _close(normed, expected_normed, dtype)


# intermediate 1100: two programs a row, the second masked past the row's end
@pytest.mark.parametrize(("rows", "intermediate"), [(1, 64), (7, 64), (7, 1100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torchs(rows, intermediate, dtype):
    x = _randn(rows, 2 * intermediate, dtype=dtype, seed=3) * 3
    out = triton_layers.silu_and_mul(x.to(TEST_DEVICE))
    assert out.dtype == dtype and out.shape == (rows, intermediate)
    _close(out, torch_silu_and_mul(x), dtype)


def _tables(max_positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's default rotary tables [max_positions, dim / 2], float32."""
    inverse_frequencies = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inverse_frequencies[None, :]
    return angles.cos(), angles.sin()


# (heads, kv_heads, dim): GQA 8 / 2 at each head_dim, and as many KV heads as query heads
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 32), (8, 2, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_rotates_the_qkv_projections_q_and_k_in_place_as_torch_does(heads, kv_heads, dim, rows, dtype):
    qkv = _randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    positions = torch.tensor([37, 2, 90, 0, 2, 63, 11][:rows])  # unsorted, one repeated
    cos, sin = _tables(100, dim)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    expected_q, expected_k = torch_apply_rotary(q.clone(), k.clone(), positions, cos, sin)

    fused = qkv.to(TEST_DEVICE)
    q_on_device = fused[:, : heads * dim].view(rows, heads, dim)
    k_on_device = fused[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    tables = cos.to(TEST_DEVICE), sin.to(TEST_DEVICE)
    rotated_q, rotated_k = triton_layers.apply_rotary(q_on_device, k_on_device, positions.to(TEST_DEVICE), *tables)
    assert rotated_q is q_on_device and rotated_k is k_on_device
    _close(fused[:, : heads * dim].view(rows, heads, dim), expected_q, dtype)
    _close(fused[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim), expected_k, dtype)
    values = slice((heads + kv_heads) * dim, None)
    torch.testing.assert_close(fused[:, values].cpu(), qkv[:, values], atol=0, rtol=0)  # V is left alone


def test_a_float64_model_on_the_layer_kernels_keeps_transformers_log_probabilities(monkeypatch):
    """The native model with its layer operations routed as on a GPU (here interpreted) against transformers'
    own forward: log-probabilities to 1e-9, over a prompt and twelve generated tokens. Computed in float32,
    the kernels put them 5.4e-7 off; in float64 with a Triton norm, 5.8e-7 (its float32 statistic)."""
    loaded = load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64")
    reference = load_model(str(BUNDLED_MODEL), str(TEST_DEVICE), "float64", model_impl="transformers")
    monkeypatch.setattr(ops, "on_triton", lambda x: True)
    harness = Harness(loaded, EngineConfig(kv_cache_bytes=64 << 20))
    try:
        prompt = loaded.tokenizer(PROMPTS[2])["input_ids"]
        [events] = harness.collect([harness.submit(prompt, 12, logprobs=0, ignore_eos=True)]).values()
    finally:
        harness.close()
    expected = _logprobs(reference, prompt + _tokens(events))
    for position, event in enumerate(events):
        [info] = event.logprobs
        assert info.logprob == pytest.approx(expected[len(prompt) - 1 + position][info.id].item(), abs=1e-9)
