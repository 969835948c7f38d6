"""Decode steps replayed from CUDA graphs: a step's hundreds of kernel launches become one.

A decode step runs the same kernels whatever its sequences; only their
number changes. So at start-up the whole forward pass is captured once per
batch-size bucket (1, 2, 4, 8, then every 16 up to the largest batch),
reading its inputs from static buffers: token ids, positions, cache slots,
block tables and sequence lengths. A step of n sequences fills the first n
rows of the buffers and replays the smallest bucket that holds them; the
rows past n are padding that writes nowhere (slot -1) and reads nothing
(length 0). Prompt chunks and mixed steps run eagerly. Where the model
serves LoRA adapters, each row's adapter slot is a static input too (-1: the
base model), and the graphs compute the pools' whole rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace

import torch

from workers.engine.attention import PagedBatch

# forward(ids [n], positions [n], batch) -> last hidden states [n, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]
# capture(run) -> (replay, output): `replay()` redoes `run()`'s work, leaving the result in `output`
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to and including max_batch_size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


def cuda_graph_capture() -> Capture:
    """Capture into CUDA graphs that share one memory pool (largest bucket first, so the others fit in it)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        return graph.replay, output

    return capture


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch_size: int,
        max_blocks: int,
        splits: Callable[[int], int],
        capture: Capture,
        lora: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        """`splits(n)`: the decode kernel's split of each sequence's blocks for a batch of n (baked in);
        `lora(slots)`: the step's LoraRows (models/lora.py) of rows' adapter slots, where adapters are served."""
        device = kv[0][0].device
        self.sizes = batch_buckets(max_batch_size)
        self._ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._positions = torch.zeros_like(self._ids)
        self._slots = torch.full_like(self._ids, -1)
        self._lengths = torch.zeros_like(self._ids)
        self._tables = torch.zeros((max_batch_size, max_blocks), dtype=torch.long, device=device)
        self._lora_slots = torch.full_like(self._ids, -1)
        self._replays: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        for size in reversed(self.sizes):
            batch = PagedBatch(
                kv=kv,
                kernels="triton",
                slots=self._slots[:size],
                decodes=size,
                block_tables=self._tables[:size],
                lengths=self._lengths[:size],
                splits=splits(size),
            )

            def run(size: int = size, batch: PagedBatch = batch) -> torch.Tensor:
                if lora is not None:  # its grouping of the rows by slot is part of the graph
                    batch = replace(batch, lora=lora(self._lora_slots[:size]))
                return forward(self._ids[:size], self._positions[:size], batch)

            run()  # warm up (compiles the kernels), on padding rows only: nothing is written or read
            self._replays[size], self._outputs[size] = capture(run)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, sequences: int) -> int:
        """The smallest captured batch size that holds this many sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, sequences)]

    def run(self, ids, positions, slots, block_tables, lengths, lora_slots) -> torch.Tensor:
        """A decode step of n sequences (n-row tensors on the device; block_tables [n, width]; lora_slots: [n], or
        empty where no row has an adapter) -> hidden [n, ...]."""
        n, width = block_tables.shape
        size = self.bucket(n)
        self._ids[:n] = ids
        self._positions[:n] = positions
        self._slots[:n] = slots
        self._slots[n:size] = -1
        self._lengths[:n] = lengths
        self._lengths[n:size] = 0
        if lora_slots.numel():
            self._lora_slots[:n] = lora_slots
            self._lora_slots[n:size] = -1
        else:
            self._lora_slots[:size] = -1
        self._tables[:n, :width] = block_tables  # columns past width: never read, for lengths stop before them
        self._replays[size]()
        return self._outputs[size][:n]
