"""Load a Hugging Face causal LM onto the CPU or a GPU: from a directory or the hub, or randomly initialised."""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass

import structlog
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.bundled import DTYPE_NAMES

log = structlog.get_logger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_position_embeddings: int
    eos_token_ids: frozenset[int]

    @property
    def device_type(self) -> str:
        return self.device.type

    def runner(self, config, capture=None):
        """The ModelRunner that computes this model's steps (see Engine); `config` has the device's defaults."""
        from workers.engine.model_runner import ModelRunner  # it imports this module

        return ModelRunner(self, config, capture)

    def grammars(self):
        """What compiles structured-output grammars for this model's tokenizer (workers/engine/grammar.py)."""
        from workers.engine.grammar import Grammars

        return Grammars(self.tokenizer, self.model.get_output_embeddings().weight.shape[0])


@dataclass(frozen=True)
class KVGeometry:
    """What a model keeps per cached token: keys and values of every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVGeometry:
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, model.dtype.itemsize)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(path: str, device: str = "auto", dtype: str | None = None) -> LoadedModel:
    """Load from a local directory or a hub id: bf16 on CUDA, fp32 on the CPU, unless `dtype` says otherwise."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    transformers.utils.logging.disable_progress_bar()  # our logs are JSON lines
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen).to(target).eval()
    return _loaded(model, tokenizer, target, str(path))


def random_model(config: transformers.PretrainedConfig, tokenizer, device: str = "auto", dtype: str | None = None):
    """A randomly initialised model of `config`, for timing where no weights are at hand."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    with torch.device(target):  # a copy of the config: the engine sets its attention on the model's own
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=chosen).eval()
    return _loaded(model, tokenizer, target, f"random {config.model_type}")


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of returning it to the system.

    Every step allocates and frees tensors of megabytes; by default glibc
    serves those with fresh mmaps whose pages fault in on first touch, which
    tripled the time of a decode step here. Process-wide; a no-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def _loaded(model, tokenizer, device: torch.device, source: str) -> LoadedModel:
    if device.type == "cpu":
        keep_freed_memory()
    config = model.config
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = tokenizer.eos_token_id
    log.info("model_loaded", source=source, device=str(device), dtype=str(model.dtype), vocab_size=config.vocab_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 1024 * 1024,
        eos_token_ids=frozenset([eos] if isinstance(eos, int) else (eos or [])),
    )
