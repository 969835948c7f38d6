"""What transformers itself generates with the bundled model: the answer e2e tests expect."""

from __future__ import annotations

from functools import cache

import torch

from workers.bundled import BUNDLED_MODEL
from workers.engine.model_loader import LoadedModel, load_model


@cache
def bundled() -> LoadedModel:
    return load_model(str(BUNDLED_MODEL), "cpu")


def greedy_text(prompt: str, max_new_tokens: int) -> str:
    """transformers' greedy `generate`, decoded as the server decodes (special tokens skipped)."""
    loaded = bundled()
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
