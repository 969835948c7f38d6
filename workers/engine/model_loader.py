"""Load a Hugging Face model onto the CPU or a GPU: from a directory or the hub, or randomly initialised.

Causal LMs, and vision-language models (a config with a `vision_config`:
LLaVA, Qwen2-VL, ...), which come with their processor (workers/engine/vision.py).
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from workers.bundled import DTYPE_NAMES
from workers.engine.pooling import Pooling

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Our logs are JSON lines: no progress bars, and transformers' lines go through the root logger
# (telemetry/logs.py) rather than its own handler's plain text.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.disable_default_handler()
transformers.utils.logging.enable_propagation()

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    processor: object = None  # a vision-language model's (images to placeholders and pixels); None: text only
    pooling: Pooling | None = Pooling()  # how its embeddings are pooled (pooling.py); None: not served

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def decoder(self) -> torch.nn.Module:
        """The transformer that turns token ids (or embeddings) into hidden states: a VLM's language model."""
        return getattr(self.model.model, "language_model", self.model.model)

    def vision(self):
        """What prepares and encodes images (workers/engine/vision.py); None for a text-only model."""
        from workers.engine.vision import Vision

        return Vision(self.model, self.processor) if self.processor is not None else None

    def runner(self, config, capture=None):
        """The ModelRunner that computes this model's steps (see Engine); `config` has the device's defaults."""
        from workers.engine.model_runner import ModelRunner  # it imports this module

        return ModelRunner(self, config, capture)

    def grammars(self):
        """What compiles structured-output grammars for this model's tokenizer (workers/engine/grammar.py)."""
        from workers.engine.grammar import Grammars

        return Grammars(self.tokenizer, self.model.get_output_embeddings().weight.shape[0])


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(path: str, device: str = "auto", dtype: str | None = None) -> LoadedModel:
    """Load from a local directory or a hub id: bf16 on CUDA, fp32 on the CPU, unless `dtype` says otherwise."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    pooling = Pooling.of_model(str(path))
    if _is_vision(AutoConfig.from_pretrained(path)):
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=chosen).to(target).eval()
        return _loaded(model, processor.tokenizer, target, str(path), processor, pooling=pooling)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen).to(target).eval()
    return _loaded(model, tokenizer, target, str(path), pooling=pooling)


def random_model(
    config: transformers.PretrainedConfig, tokenizer, device: str = "auto", dtype: str | None = None, processor=None
):
    """A randomly initialised model of `config`, for timing where no weights are at hand, and for tests
    (a vision-language model's config takes its `processor`, whose tokenizer is `tokenizer`)."""
    target = pick_device(device)
    chosen = DTYPES[dtype] if dtype else (torch.bfloat16 if target.type == "cuda" else torch.float32)
    auto = AutoModelForImageTextToText if _is_vision(config) else AutoModelForCausalLM
    with torch.device(target):  # a copy of the config: the engine sets its attention on the model's own
        model = auto.from_config(copy.deepcopy(config), dtype=chosen).eval()
    return _loaded(model, tokenizer, target, f"random {config.model_type}", processor, pooling=Pooling())


def _is_vision(config: transformers.PretrainedConfig) -> bool:
    return getattr(config, "vision_config", None) is not None


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


def _loaded(
    model, tokenizer, device: torch.device, source: str, processor=None, *, pooling: Pooling | None
) -> LoadedModel:
    if device.type == "cpu":
        keep_freed_memory()
    config = model.config.get_text_config()
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 1024 * 1024,
        eos_token_ids=frozenset([eos] if isinstance(eos, int) else (eos or [])),
        processor=processor,
        pooling=pooling,
    )
