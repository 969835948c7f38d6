"""A step's embeddings: the hidden-state rows its embed requests pool, and the vectors they become.

How each prompt is pooled (mean or last token, normalised or not) is its
sequence's Pooling (pooling.py); this is the step's side, which the model
runner calls with the step's chunks and, after the forward, its hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.scheduler import Chunk


@dataclass(frozen=True)
class PooledRows:
    """The rows of a step that its embed requests pool: every row of a mean-pooled chunk, and the last row of
    a last-token-pooled prompt's last chunk."""

    rows: list[int]
    spans: list[tuple[Chunk, int]]  # (chunk, its rows), in row order

    @classmethod
    def of(cls, chunks: list[Chunk], first_rows: list[int]) -> PooledRows:
        rows: list[int] = []
        spans: list[tuple[Chunk, int]] = []
        for chunk, first_row in zip(chunks, first_rows, strict=True):
            pooling = chunk.sequence.pooling
            if pooling is None or not (pooling.mean or chunk.reaches_end):
                continue
            count = chunk.num_tokens if pooling.mean else 1
            rows.extend(range(first_row + chunk.num_tokens - count, first_row + chunk.num_tokens))
            spans.append((chunk, count))
        return cls(rows, spans)

    def pool(self, hidden: torch.Tensor) -> dict[str, list[float]]:
        """From the hidden states of `rows`: request id -> the embedding of each prompt completed this step."""
        hidden = hidden.to(torch.promote_types(hidden.dtype, torch.float32))  # a bfloat16 sum of many rows drifts
        done: list[tuple[str, torch.Tensor]] = []
        start = 0
        for chunk, count in self.spans:
            sequence, rows = chunk.sequence, hidden[start : start + count]
            start += count
            if sequence.pooling.mean:
                first = sequence.num_cached_tokens == 0  # the step has not counted its chunk in yet
                sequence.pooled_sum = rows.sum(dim=0) if first else sequence.pooled_sum + rows.sum(dim=0)
            if chunk.reaches_end:
                vector = sequence.pooled_sum / len(sequence.prompt_ids) if sequence.pooling.mean else rows[-1]
                done.append((sequence.request_id, F.normalize(vector, dim=0) if sequence.pooling.normalize else vector))
        if not done:
            return {}
        vectors = torch.stack([vector for _, vector in done]).tolist()  # one read from the device
        return {request_id: vector for (request_id, _), vector in zip(done, vectors, strict=True)}
