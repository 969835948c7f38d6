"""What transformers itself generates and embeds with the bundled model: the answers e2e tests expect.

The model is transformers' own (its modeling classes), whatever the server runs it on.
"""

from __future__ import annotations

from functools import cache

import torch

from workers.bundled import BUNDLED_MODEL
from workers.engine.model_loader import LoadedModel, load_model


@cache
def bundled() -> LoadedModel:
    return load_model(str(BUNDLED_MODEL), "cpu", model_impl="transformers")


def greedy_text(prompt: str, max_new_tokens: int) -> str:
    """transformers' greedy `generate`, decoded as the server decodes (special tokens skipped)."""
    loaded = bundled()
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def embedding(token_ids: list[int], mean: bool = False, normalize: bool = True) -> torch.Tensor:
    """transformers' hidden states of the bundled model (its base model, float32, after the final norm), pooled
    as workers/engine/pooling.py pools them: the last token's, or the mean, then L2-normalised if asked."""
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        hidden = bundled().model.model(input_ids=ids).last_hidden_state[0]
    vector = hidden.mean(dim=0) if mean else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
