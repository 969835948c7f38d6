"""Embeddings: how a prompt's hidden states are pooled into one vector, as the model's directory says.

An embed request (task "embed") is a prefill whose answer is its prompt's
last hidden states (after the final norm) pooled, with no token drawn. A
directory that sentence-transformers saved says how: its `modules.json`
names a Pooling module, whose config gives the mode (mean or last token),
and whether a Normalize module follows. Other directories get vLLM's default
for decoder-only models: the last token's hidden state, L2-normalised.

Last-token pooling reads one row, of the prompt's last chunk; the prefix
cache never holds a prompt's last token, so it is always computed. Mean
pooling needs every prompt token's row: its sequences take nothing from the
prefix cache (cached tokens are never computed again), and each chunk's rows
are summed onto the sequence's running sum, which restarts with the prompt's
first chunk (after a preemption too): pooled_rows.py does it, step by step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import structlog
from transformers.utils import cached_file

log = structlog.get_logger(__name__)

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES = {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}  # the modes served: name -> mean


@dataclass(frozen=True)
class Pooling:
    mean: bool = False  # the mean of every prompt token's hidden state; else the last token's
    normalize: bool = True  # scaled to unit L2 norm

    @classmethod
    def of_model(cls, path: str) -> Pooling | None:
        """As the sentence-transformers modules of the model at `path` (a directory or a hub id) say; the
        default without them; None (embeddings not served) for modules that change the vector otherwise."""
        modules = _read_json(path, "modules.json")
        if modules is None:
            return cls()
        types = [module["type"] for module in modules]
        pooling = next((m for m in modules if m["type"] == _POOLING), None)
        unserved = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        config = _read_json(path, f"{pooling['path']}/config.json") if pooling is not None else None
        modes = [name for name, chosen in (config or {}).items() if name.startswith("pooling_mode") and chosen]
        if unserved or len(modes) != 1 or modes[0] not in _MODES:
            log.warning("embeddings_not_served", model=path, modules=types, pooling_modes=modes)
            return None
        return cls(mean=_MODES[modes[0]], normalize=_NORMALIZE in types)


def _read_json(path: str, name: str):
    """A JSON file of the model's, from its directory or the hub; None if it has none."""
    if os.path.isdir(path):
        file = os.path.join(path, name)
        found = file if os.path.isfile(file) else None
    else:
        found = cached_file(
            path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
        )
    if found is None:
        return None
    with open(found) as text:
        return json.load(text)
