"""Qwen3: Llama's decoder with an RMSNorm over each head of q and k before the rotary, and no QKV bias.

Its head_dim (128) is set by the config, not hidden_size / heads.
"""

from __future__ import annotations

from workers.engine.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def options(cls, config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
