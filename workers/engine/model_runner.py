"""Load a Hugging Face causal LM and run it, one sequence at a time.

Each sequence keeps its own transformers KV cache, so sequences join and
leave between steps at no cost to the others. This is the simple scheme of
the walking skeleton: correct and exact, but one forward pass per sequence
per step; batched attention over a paged cache replaces it.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import structlog
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from workers.engine.sequence import Sequence

log = structlog.get_logger(__name__)

BUNDLED_MODEL = pathlib.Path(__file__).resolve().parent.parent / "bundled_model"


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_position_embeddings: int
    eos_token_ids: frozenset[int]


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(path: str, device: str = "auto") -> LoadedModel:
    """Load from a local directory or a hub id: bf16 on CUDA, fp32 on the CPU."""
    target = pick_device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    transformers.utils.logging.disable_progress_bar()  # our logs are JSON lines
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(target).eval()
    config = model.config
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    log.info("model_loaded", path=str(path), device=str(target), dtype=str(dtype), vocab_size=config.vocab_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=target,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 1024 * 1024,
        eos_token_ids=eos_ids,
    )


class ModelRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self._model = loaded.model
        self._device = loaded.device

    @torch.inference_mode()
    def next_logits(self, sequence: Sequence) -> torch.Tensor:
        """Logits for the position after the sequence's last token, shape (vocab,).

        The first call prefills the whole prompt; later ones feed only the
        tokens the cache has not seen.
        """
        if sequence.kv_cache is None:
            sequence.kv_cache = DynamicCache(config=self._model.config)
        seen = sequence.kv_cache.get_seq_length()
        new_ids = torch.tensor([sequence.token_ids[seen:]], device=self._device)
        output = self._model(input_ids=new_ids, cache=sequence.kv_cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1]
