"""Decode graphs on the CPU, with the capture step replaced: buckets, padding rows, static buffers.

The replaced capture records the forward pass's function and replays it
eagerly from the same static buffers, so what a replay sees is what a CUDA
graph's kernels would read.
"""

from __future__ import annotations

import torch

from workers.engine.attention import PagedBatch
from workers.engine.cuda_graphs import DecodeGraphs, batch_buckets


def replay_eagerly(run):
    """A stand-in for CUDA graph capture: replaying reruns the forward pass and leaves its result in place."""
    output = run()
    return (lambda: output.copy_(run())), output


def test_buckets_are_powers_of_two_to_8_then_every_16_up_to_the_largest_batch():
    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


class Recorder:
    """A forward pass that returns, per row, what it read from the static buffers."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, int]] = []  # (batch size, splits) in capture order

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        if len(self.captured) < 6:
            self.captured.append((batch.decodes, batch.splits))
        columns = [ids, positions, batch.slots, batch.lengths, batch.block_tables.sum(dim=1)]
        return torch.stack(columns, dim=1).float()


def _graphs(recorder: Recorder, max_batch_size: int = 24) -> DecodeGraphs:
    kv = [(torch.zeros(2, 10, 4, 8), torch.zeros(2, 10, 4, 8))]
    return DecodeGraphs(recorder, kv, max_batch_size, 6, lambda n: 100 + n, replay_eagerly)


def _run(graphs: DecodeGraphs, n: int, width: int) -> torch.Tensor:
    ids = torch.arange(n) + 1000
    tables = torch.arange(n * width).view(n, width) + 1
    return graphs.run(ids, ids + 1, ids * 10, tables, torch.full((n,), 7), torch.empty(0, dtype=torch.long))


def test_every_bucket_is_captured_largest_first_with_its_own_splits():
    recorder = Recorder()
    graphs = _graphs(recorder)
    # Each bucket ran once to warm up, then once more inside the (replaced) capture.
    assert recorder.captured == [(24, 124), (24, 124), (16, 116), (16, 116), (8, 108), (8, 108)]
    assert graphs.sizes == [1, 2, 4, 8, 16, 24] and graphs.max_batch_size == 24
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 24]


def test_a_step_fills_its_rows_and_the_bucket_rows_past_it_write_and_read_nothing():
    graphs = _graphs(Recorder())
    wide = _run(graphs, 11, 6)  # bucket 16: every buffer's first 11 rows now hold this step
    assert wide.shape == (11, 5)
    assert wide[:, 0].tolist() == list(range(1000, 1011)) and wide[:, 2].tolist() == [i * 10 for i in range(1000, 1011)]
    narrow = _run(graphs, 3, 2)  # bucket 4, after a wider step left its rows behind
    assert narrow.shape == (3, 5)
    assert narrow[:, 0].tolist() == [1000, 1001, 1002] and narrow[:, 1].tolist() == [1001, 1002, 1003]
    assert narrow[:, 3].tolist() == [7, 7, 7]
    # Tables: the step's own columns, then what earlier steps left, which lengths keep out of reach.
    assert narrow[0, 4] == 1 + 2 + (3 + 4 + 5 + 6)
    padding = graphs._outputs[4][3]  # the bucket's fourth row, as the replay saw it
    assert padding[2] == -1 and padding[3] == 0  # slot -1: writes nowhere; length 0: reads nothing


def test_a_full_bucket_has_no_padding():
    graphs = _graphs(Recorder())
    out = _run(graphs, 24, 6)
    assert out[:, 2].tolist() == [i * 10 for i in range(1000, 1024)]
