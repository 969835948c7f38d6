"""Llama (1, 2, 3, 3.1, 3.2) and Mistral: the plain decoder of layers.py.

Llama's config may turn on biases (`attention_bias`: q, k, v and o;
`mlp_bias`); its rotary scaling (`rope_type` linear, dynamic, llama3, yarn)
is layers.Rotary's. Mistral is the same architecture without them; a sliding
window, where its config has one, is refused by the model runner past the
window's length (the paged attention has none).
"""

from __future__ import annotations

from workers.engine.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def options(cls, config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(getattr(config, "mlp_bias", False))}


class MistralForCausalLM(CausalLM):
    pass
