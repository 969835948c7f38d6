"""A transformers model as the engine's decoder: the fallback for architectures with no native family.

transformers computes embeddings, rotary positions, projections and MLPs as
its modeling classes do, and hands each layer's query, key and value to
`paged_attention`, registered in its attention interface, which reads and
writes the engine's paged cache (attention.attend). Vision-language models
run here too: their language model takes the step's image features as
embeddings, and 3-D rotary positions ([3, 1, rows]) where the model has them.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from workers.engine.attention import PagedBatch, attend

IMPLEMENTATION = "tokenrelay_paged"


def paged_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, paged=None, **kwargs):
    """transformers' attention signature: query [1, heads, tokens, dim], key/value [1, kv_heads, tokens, dim]."""
    rows_first = [t[0].transpose(0, 1) for t in (query, key, value)]  # [tokens, heads, dim]
    return attend(paged, module.layer_idx, *rows_first, scaling).unsqueeze(0), None


AttentionInterface.register(IMPLEMENTATION, paged_attention)


class TransformersDecoder:
    """The language model of a transformers causal LM (or of a vision-language model), on the paged cache."""

    implementation = "transformers"

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = getattr(model.model, "language_model", model.model)
        self._model.set_attn_implementation(IMPLEMENTATION)  # a vision tower keeps its own
        self.layers = self._model.layers
        self.num_attention_heads = self._model.config.num_attention_heads

    def reserve(self, positions: int) -> None:
        """transformers computes each step's rotary angles: nothing to make ready."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._model.get_input_embeddings()(ids)

    def hidden_states(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        paged: PagedBatch,
        embeddings: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions`: [rows], or [3, 1, rows] for 3-D rotary positions; `rows`: the rows wanted (all: None),
        taken from the whole step's states: transformers' layers compute every row."""
        inputs = {"input_ids": ids[None]} if embeddings is None else {"inputs_embeds": embeddings[None]}
        positions = positions[None] if positions.dim() == 1 else positions
        hidden = self._model(**inputs, position_ids=positions, use_cache=False, paged=paged).last_hidden_state[0]
        return hidden if rows is None else hidden[rows]
