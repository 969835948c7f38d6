"""LoRA on the native models: each projection's device pool of adapter slots (a step's rows by slot: lora_rows.py).

An adapter is never merged into the weights: a step mixes rows of several
adapters and of the base model, so each adapted projection adds, for the
whole step at once, every row's x·Aᵀ·Bᵀ under the adapter of its sequence
(the slot it holds in the pool). In torch on the CPU: with one adapter in
the step, its product pair for its rows; with several, every row's products
under each adapter present, those of the others masked to exact zeros (two
large products cost less than two small ones per adapter, on a small model:
rows sorted by adapter, each adapter's pair on its own rows, is less work,
but its products' shapes change every step, and a new shape costs the CPU
kernels more than the work saved), with the adapters' matrices stacked once
per mix of adapters, not per step. On a GPU two Triton kernels over the
rows grouped by slot (triton_lora.py), the same launches whatever the mix,
so that decode graphs capture them with the rows' slots as a static input.

A projection's pool holds `slots` adapters of rank up to R for each of its
parts (q, k and v of the fused QKV; gate and up): A [slots, R·P, inputs],
Bᵀ [slots, R·P, outputs], scaling folded into B, zeros where an adapter has
a lower rank or does not target a part (which adds exactly nothing). The
rank index is the major one (row i·P + p is part p's i-th component), so a
step whose adapters all have rank ≤ r computes with the first r·P rows
only: a view, not a copy.
"""

from __future__ import annotations

import torch

from workers.engine.lora_rows import LoraRows

_STACKED_MIXES = 8  # a pool's stacked copies kept at most (see LoraPool._stacked)


class LoraPool:
    """One projection's adapter slots: A [slots, R·P, inputs] and Bᵀ [slots, R·P, outputs] (see above)."""

    def __init__(self, slots: int, rank: int, inputs: int, parts: dict[str, tuple[int, int]], device, dtype) -> None:
        """`parts`: part name -> (first output row, rows) within the projection's output."""
        self.parts, self.max_rank = parts, rank
        width = rank * len(parts)
        self.a = torch.zeros(slots, width, inputs, device=device, dtype=dtype)
        self.b = torch.zeros(slots, width, sum(rows for _, rows in parts.values()), device=device, dtype=dtype)
        # On the CPU, (present slots, rank) -> their A and Bᵀ stacked [present·R·P, inputs or outputs]: a step
        # mixing adapters computes with them, and the next steps mostly mix the same ones.
        self._stacked: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Fill `slot` with an adapter's A [r, inputs] and B [rows, r] per part it targets; zeros elsewhere."""
        count = len(self.parts)
        a = self.a[slot].view(self.max_rank, count, -1)
        b = self.b[slot].view(self.max_rank, count, -1)
        a.zero_()
        b.zero_()
        self._stacked.clear()
        for index, (name, (first, rows)) in enumerate(self.parts.items()):
            if name in weights:
                lora_a, lora_b = weights[name]
                rank = lora_a.shape[0]
                a[:rank, index] = lora_a.to(a.dtype)
                b[:rank, index, first : first + rows] = (lora_b.double() * scaling).T.to(b.dtype)

    def add(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> None:
        """y += each row's x·Aᵀ·Bᵀ under its slot, in place."""
        width = rows.rank * len(self.parts)
        a, b = self.a[:, :width], self.b[:, :width]
        if y.is_cuda:
            from workers.engine import triton_lora

            triton_lora.add_lora(y, x, a, b.transpose(1, 2), rows.order, rows.starts, rows.counts)
        elif len(rows.groups) == 1:
            slot, index = rows.groups[0]
            if index is None:
                y.addmm_(x @ a[slot].T, b[slot])
            else:
                y.index_add_(0, index, (x[index] @ a[slot].T) @ b[slot])
        elif rows.groups:  # every present slot's products for every row, the others' masked to exact zeros
            stacked_a, stacked_b = self._stacked_for(rows.present, rows.rank)
            shrunk = (x @ stacked_a.T).view(x.shape[0], len(rows.present), width) * rows.mask(x.dtype)[:, :, None]
            y.addmm_(shrunk.view(x.shape[0], -1), stacked_b)

    def _stacked_for(self, present: tuple[int, ...], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots `present`'s A and Bᵀ at `rank`, each stacked into one matrix: copied once per mix, or
        views of the pools where the mix is every slot at the pools' rank."""
        key = (present, rank)
        if key not in self._stacked:
            width = rank * len(self.parts)
            if len(self._stacked) >= _STACKED_MIXES:
                self._stacked.clear()
            if present == tuple(range(self.a.shape[0])) and rank == self.max_rank:
                a, b = self.a, self.b
            else:
                index = torch.tensor(present, device=self.a.device)
                a, b = self.a[:, :width].index_select(0, index), self.b[:, :width].index_select(0, index)
            self._stacked[key] = (a.reshape(-1, a.shape[2]), b.reshape(-1, b.shape[2]))
        return self._stacked[key]
