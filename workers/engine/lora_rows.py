"""A step's rows by LoRA adapter: the pool slot each row computes under, grouped as the kernels take them.

The model runner makes one per step from its sequences' adapters; it rides
on the step's PagedBatch (attention.py) to every adapted projection, whose
pool (models/lora.py) computes each row under its slot. It sits below both,
as the step's own description, so that neither imports the other for it.
"""

from __future__ import annotations

import torch


class LoraRows:
    """Which pool slot each row of a step computes under (-1: the base model's), and the pools' used rank."""

    def __init__(self, slots: torch.Tensor, rank: int, pool_slots: int) -> None:
        self.slots, self.rank, self._pool_slots = slots, rank, pool_slots
        self._selected: tuple[torch.Tensor, LoraRows] | None = None
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # on the CPU: (slot, its rows; None: every row)
        if slots.is_cuda:  # device tensors of fixed shapes only (no bincount: it syncs), so that a graph captures it
            counts = torch.zeros(pool_slots + 1, dtype=torch.long, device=slots.device)
            counts.scatter_add_(0, slots + 1, torch.ones_like(slots))
            self.order = torch.argsort(slots, stable=True)
            self.counts = counts[1:]
            self.starts = torch.cumsum(counts, 0)[:-1]  # base rows (-1) sort first
            return
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        every = len(by_slot) == 1 and len(next(iter(by_slot.values()))) == slots.numel()
        self.groups = [(slot, None if every else torch.tensor(rows)) for slot, rows in by_slot.items()]
        self.present = tuple(sorted(by_slot))  # the slots the step's rows compute under
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, present slots]: 1 where the row computes under that slot, else 0."""
        if dtype not in self._masks:
            self._masks[dtype] = (self.slots[:, None] == torch.tensor(self.present)[None, :]).to(dtype)
        return self._masks[dtype]

    def select(self, kept: torch.Tensor) -> LoraRows:
        """The rows `kept` (a last layer's), in their order; the same object for the same `kept`."""
        if self._selected is None or self._selected[0] is not kept:
            self._selected = (kept, LoraRows(self.slots[kept], self.rank, self._pool_slots))
        return self._selected[1]
