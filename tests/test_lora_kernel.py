"""The LoRA kernels (workers/engine/triton_lora.py) against a float64 loop over the rows.

They run here under Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), or
compiled on a GPU with TOKENRELAY_TEST_DEVICE=cuda. The reference adds each row's products under the slot
the row itself names, never through the kernels' grouping of the rows, with every slot's adapter distinct
and each product about as large as y: a row given another slot's adapter, or none, is off by far more than
the tolerance. Rows of no slot, and the columns beside y's view, must come out bit for bit as they went in.
The pools are laid out as the engine's (models/lora.py): the first R ranks of wider ones, B a transposed
view of its Bᵀ, with their other ranks nonzero so that a kernel reading past R is caught. In 16 bits the
kernels round x·Aᵀ once, as torch does, and y once; in float64 (the exactness tests' dtype) they compute in
float64, and only the order of the sums differs. bfloat16's tl.dot does not run under the interpreter: it is
checked on a GPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.devices import TEST_DEVICE
from workers.engine import triton_lora

# 16 bits: about 8 units of the dtype's rounding, 2**-11 for float16 and 2**-8 for bfloat16 (8 bits of
# significand), against a float64 reference over the same rounded inputs: 8 times float16's for bfloat16. The worst
# error measured, as the least tolerance taken both ways: float16 8.4e-4, bfloat16 5.0e-3 (the kernels run on the
# CPU under Triton's interpreter, made to multiply bfloat16 exactly and round to nearest even as a GPU does).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}
DTYPES = [torch.float64, torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE.type == "cuda" else [])
POOL_SLOTS = 4
SPARE_RANKS = 8  # the pools' ranks past the step's R


@dataclass(frozen=True)
class Case:
    rows_per_slot: tuple[int, ...]  # POOL_SLOTS counts, 0 for an idle slot
    base_rows: int  # rows of no slot
    rank: int
    inputs: int
    outputs: int
    splits: int  # the shrink's: 1 unless inputs exceed 512
    base_rows_last: bool = False  # the rows of no slot after every slot's in `order`, not before


CASES = {
    # an idle slot, a slot of more rows than a program's 16, a slot of one row; outputs in two tiles of 128
    "mixed": Case((3, 0, 20, 1), base_rows=5, rank=24, inputs=40, outputs=200, splits=1),
    # the inputs in two splits, of 320 and 280 (no multiple of 64)
    "split": Case((2, 17, 0, 4), base_rows=3, rank=48, inputs=600, outputs=72, splits=2, base_rows_last=True),
    # a fused QKV's three ranks of 64 stacked: one shrink tile of 256, three expand steps of 64
    "qkv": Case((1, 2, 0, 3), base_rows=2, rank=192, inputs=32, outputs=48, splits=1),
    "one-row": Case((0, 1, 0, 0), base_rows=0, rank=24, inputs=40, outputs=24, splits=1),
}


def _randn(*size: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _row_slots(case: Case) -> torch.Tensor:
    """Each row's slot (-1: none), the slots' rows interleaved in a random order."""
    slots = [slot for slot, count in enumerate(case.rows_per_slot) for _ in range(count)] + [-1] * case.base_rows
    shuffle = torch.randperm(len(slots), generator=torch.Generator().manual_seed(7))
    return torch.tensor(slots)[shuffle]


def _grouped(row_slots: torch.Tensor, base_rows_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """order, starts, counts as LoraRows builds them (models/lora.py), the rows of no slot first or last."""
    keys = torch.where(row_slots < 0, POOL_SLOTS, row_slots) if base_rows_last else row_slots
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(row_slots + 1, minlength=POOL_SLOTS + 1)
    starts = torch.cumsum(counts, 0)[:-1] - (counts[0] if base_rows_last else 0)
    return order, starts, counts[1:]


def _expected(y, x, a, b, row_slots: torch.Tensor) -> torch.Tensor:
    expected = y.to(torch.float64, copy=True)  # never y itself, a float64 y included
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            expected[row] += (x[row].double() @ a[slot].double().T) @ b[slot].double().T
    return expected


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_adds_each_rows_product_under_its_own_slot(case, dtype):
    row_slots = _row_slots(case)
    rows, rank, inputs, outputs = len(row_slots), case.rank, case.inputs, case.outputs
    wide_x = _randn(rows, inputs + 8, dtype=dtype, seed=0)
    wide_y = _randn(rows, outputs + 16, dtype=dtype, seed=1)
    a_pool = _randn(POOL_SLOTS, rank + SPARE_RANKS, inputs, dtype=dtype, seed=2, scale=inputs**-0.5)
    bt_pool = _randn(POOL_SLOTS, rank + SPARE_RANKS, outputs, dtype=dtype, seed=3, scale=rank**-0.5)
    x, y = wide_x[:, 4 : 4 + inputs], wide_y[:, 8 : 8 + outputs]
    a, b = a_pool[:, :rank], bt_pool[:, :rank].transpose(1, 2)
    expected = _expected(y, x, a, b, row_slots)

    on_device = [t.to(TEST_DEVICE, copy=True) for t in (wide_y, wide_x, a_pool, bt_pool)]  # the inputs kept
    device_y, device_x = on_device[0][:, 8 : 8 + outputs], on_device[1][:, 4 : 4 + inputs]
    device_a, device_b = on_device[2][:, :rank], on_device[3][:, :rank].transpose(1, 2)
    grouped = [t.to(TEST_DEVICE) for t in _grouped(row_slots, case.base_rows_last)]
    shrink, _ = triton_lora.lora_launches(device_y, device_x, device_a, device_b, *grouped)
    assert shrink.grid[1] == case.splits
    triton_lora.add_lora(device_y, device_x, device_a, device_b, *grouped)

    result = on_device[0].cpu()
    adapted = row_slots >= 0
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(
        result[adapted, 8 : 8 + outputs].double(), expected[adapted], atol=tolerance, rtol=tolerance
    )
    assert torch.equal(result[~adapted], wide_y[~adapted])
    assert torch.equal(result[:, :8], wide_y[:, :8]) and torch.equal(result[:, 8 + outputs :], wide_y[:, 8 + outputs :])


def test_add_lora_takes_contiguous_pools_and_changes_nothing_without_rows_of_a_slot():
    case = CASES["mixed"]
    row_slots = _row_slots(case)
    rows, rank = len(row_slots), case.rank
    x = _randn(rows, case.inputs, dtype=torch.float32, seed=4)
    y = _randn(rows, case.outputs, dtype=torch.float32, seed=5)
    a = _randn(POOL_SLOTS, rank, case.inputs, dtype=torch.float32, seed=6, scale=case.inputs**-0.5)
    b = _randn(POOL_SLOTS, case.outputs, rank, dtype=torch.float32, seed=7, scale=rank**-0.5)
    device = [t.to(TEST_DEVICE, copy=True) for t in (y, x, a, b)]
    triton_lora.add_lora(*device, *(t.to(TEST_DEVICE) for t in _grouped(row_slots, base_rows_last=False)))
    tolerance = TOLERANCE[torch.float32]
    torch.testing.assert_close(
        device[0].cpu().double(), _expected(y, x, a, b, row_slots), atol=tolerance, rtol=tolerance
    )

    no_slot = torch.full((rows,), -1)
    unchanged = y.to(TEST_DEVICE, copy=True)
    triton_lora.add_lora(unchanged, *device[1:], *(t.to(TEST_DEVICE) for t in _grouped(no_slot, base_rows_last=False)))
    assert torch.equal(unchanged.cpu(), y)
