"""Qwen2 and Qwen2.5: Llama's decoder with biases on the q, k and v projections (not on o).

Qwen2.5's long-context checkpoints scale their rotary with `yarn`
(layers.Rotary).
"""

from __future__ import annotations

from workers.engine.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def options(cls, config) -> dict:
        return {"qkv_bias": True}
