"""The engine's own model code, by the architecture a model's config names.

A registered architecture runs natively (layers.py and a file per family);
any other runs through transformers' modeling classes with the engine's
paged attention (transformers_backed.py). Native models load straight from
safetensors (weights.py) and import nothing of transformers' modeling, so
that a worker starts without it.
"""

from __future__ import annotations

from workers.bundled import MODEL_IMPLS
from workers.engine.models.layers import CausalLM
from workers.engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from workers.engine.models.qwen2 import Qwen2ForCausalLM
from workers.engine.models.qwen3 import Qwen3ForCausalLM

__all__ = ["FAMILIES", "MODEL_IMPLS", "native_family"]

FAMILIES: dict[str, type[CausalLM]] = {
    family.__name__: family for family in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
}


_BY_MODEL_TYPE = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def native_family(config) -> type[CausalLM] | None:
    """The native implementation of the config's architecture (of its model type, for a config built in code that
    names none); None where there is none."""
    architectures = getattr(config, "architectures", None)
    if architectures:
        return next((FAMILIES[a] for a in architectures if a in FAMILIES), None)
    return _BY_MODEL_TYPE.get(config.model_type)
