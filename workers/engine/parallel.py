"""Tensor parallelism's pieces: which part of a layer a rank owns, and the collectives between the ranks.

A worker of tensor-parallel size N is N processes, one per device, in one
torch.distributed group (NCCL on GPUs, gloo on the CPU). Each rank holds a
1/N share of every layer (models/layers.py says which share, by the `Span`s
here); rank 0 is the worker itself and drives the others (ranks.py), every
step, with one broadcast of the step's packed layout (model_runner.py).

What a rank owns of a dimension is a `Span`: query heads, the MLP's
intermediate rows and the vocabulary are split in N equal parts (the
vocabulary's last part shorter); KV heads are split where there are at least
N of them, and where there are fewer each is replicated on N / kv_heads
ranks (as vLLM does), so that each rank's query heads find theirs locally.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class Span:
    """The part [start, start + count) of a dimension of `total` that a rank owns."""

    total: int
    start: int = 0
    count: int | None = None  # None: to the end

    @property
    def size(self) -> int:
        return self.total - self.start if self.count is None else self.count

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.size == self.total


# What rank 0 tells the others, first in the header it broadcasts (send/receive); the rest of the header
# says what follows (model_runner.py).
OP_RUNNER, OP_STEP, OP_LOGITS, OP_CLOSE, OP_EXIT = range(1, 6)
HEADER = 16  # int64s


@dataclass
class CollectiveClock:
    """Time this process spends in collectives (their waits for the other ranks included): what
    `tokenrelay bench engine --tensor-parallel-size` reports as their share of a step. On the CPU (gloo) a
    collective returns when it is done; NCCL's return once queued, so on GPUs this counts the queueing only."""

    seconds: float = 0.0

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started


COLLECTIVES = CollectiveClock()


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its worker's group of ranks; size 1: no group, and every collective is none."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where the collectives' tensors live (NCCL: the rank's GPU)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def split(self, total: int, what: str) -> Span:
        """An equal 1/size share of `total` (heads, intermediate rows), which must divide by the size."""
        if total % self.size:
            raise ValueError(f"tensor parallel size {self.size} must divide the model's {what} ({total})")
        share = total // self.size
        return Span(total, self.rank * share, share)

    def kv_heads(self, kv_heads: int) -> Span:
        """The KV heads this rank's query heads read: its share of them, or the one it replicates."""
        if kv_heads >= self.size:
            return self.split(kv_heads, "key-value heads")
        if self.size % kv_heads:
            raise ValueError(
                f"tensor parallel size {self.size} must be a multiple of the model's {kv_heads} key-value heads "
                "where it exceeds them"
            )
        return Span(kv_heads, self.rank // (self.size // kv_heads), 1)

    def vocabulary(self, vocab: int) -> Span:
        """The rows of the vocabulary this rank holds: a 1/size share, rounded up (the last rank's is smaller)."""
        share = -(-vocab // self.size)
        if (self.size - 1) * share >= vocab:
            raise ValueError(f"tensor parallel size {self.size} leaves a rank none of the {vocab} vocabulary rows")
        start = self.rank * share
        return Span(vocab, start, min(share, vocab - start))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each one's `x`, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            with COLLECTIVES.timing():
                dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x`, in place on every rank."""
        with COLLECTIVES.timing():
            dist.broadcast(x, 0)
        return x

    def send(self, op: int, *values: int) -> None:
        """Rank 0: tell the other ranks what comes next (`receive` there)."""
        header = torch.zeros(HEADER, dtype=torch.long)
        header[: 1 + len(values)] = torch.tensor([op, *values])
        self.broadcast(header.to(self.device))

    def receive(self) -> list[int]:
        """The other ranks: rank 0's next `send`, [op, values..., zeros]."""
        return self.broadcast(torch.empty(HEADER, dtype=torch.long, device=self.device)).tolist()

    def send_object(self, value: object) -> None:
        """Rank 0, once per runner: what is not a tensor (the engine's config)."""
        dist.broadcast_object_list([value], src=0, device=self.device)

    def receive_object(self) -> object:
        values = [None]
        dist.broadcast_object_list(values, src=0, device=self.device)
        return values[0]

    def agree_min(self, value: int) -> int:
        """The least of every rank's `value` (KV cache blocks: each rank's device has its own free memory)."""
        if self.size == 1:
            return value
        least = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        return int(least.item())

    def gather_columns(self, x: torch.Tensor, share: int, total: int) -> torch.Tensor | None:
        """Every rank's `x` [rows, at most share] side by side on rank 0, [rows, total]; None on the others.
        (Shorter parts are padded to `share` to be gathered: only a last rank's is, so the cut is at the end.)"""
        if self.size == 1:
            return x
        padded = F.pad(x, (0, share - x.shape[1])) if x.shape[1] < share else x.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.leader else None
        with COLLECTIVES.timing():
            dist.gather(padded, parts, dst=0)
        return torch.cat(parts, dim=1)[:, :total] if parts is not None else None


SINGLE = TensorParallel()
