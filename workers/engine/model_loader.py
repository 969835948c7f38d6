"""Load a Hugging Face model onto the CPU or a GPU: from a directory or the hub, or randomly initialised.

Causal LMs, and vision-language models (a config with a `vision_config`:
LLaVA, Qwen2-VL, ...), which come with their processor (workers/engine/vision.py).
A causal LM of a native family (models/) runs on the engine's own model code,
loaded from the directory's safetensors (`model_impl` "auto", or "native");
any other model, a hub id, and `model_impl` "transformers" run on
transformers' modeling classes. The config, tokenizer, chat template and
generation config come from transformers' loaders either way. A native model
may be split across devices (`tensor_parallel_size`): this process is then
rank 0 and starts the others (ranks.py), and each loads its share.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from workers.bundled import DTYPE_NAMES
from workers.engine.model_runner import ModelRunner
from workers.engine.models import FAMILIES, MODEL_IMPLS, native_family
from workers.engine.models.layers import CausalLM, Shape
from workers.engine.models.weights import checkpoint_files, load_checkpoint, load_tensors
from workers.engine.parallel import SINGLE, TensorParallel
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
    parallel: TensorParallel = SINGLE  # this process's rank, where the model is split across ranks
    ranks: object = None  # on rank 0 of a split model, the other ranks (ranks.Ranks)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.size

    @property
    def implementation(self) -> str:
        """ "native" (models/) or "transformers"."""
        return "native" if isinstance(self.model, CausalLM) else "transformers"

    def decoder(self):
        """What turns a step's token ids (or embeddings) into hidden states: the native model itself, or a VLM's
        language model or a causal LM's transformer, with the engine's attention set on it."""
        if isinstance(self.model, CausalLM):
            return self.model
        from workers.engine.models.transformers_backed import TransformersDecoder  # imports transformers' modeling

        return TransformersDecoder(self.model)

    def vision(self):
        """What prepares and encodes images (workers/engine/vision.py); None for a text-only model."""
        from workers.engine.vision import Vision

        return Vision(self.model, self.processor) if self.processor is not None else None

    def runner(self, config, capture=None, draft=None):
        """The ModelRunner that computes this model's steps (see Engine); `config` has the device's defaults."""
        return ModelRunner(self, config, capture, draft)

    def grammars(self):
        """What compiles structured-output grammars for this model's tokenizer (workers/engine/grammar.py)."""
        from workers.engine.grammar import Grammars

        logits = self.vocab_size if self.parallel.size > 1 else self.model.get_output_embeddings().weight.shape[0]
        return Grammars(self.tokenizer, logits)

    def close(self) -> None:
        """Where the model is split: the other ranks exit (else nothing to do)."""
        if self.ranks is not None:
            self.ranks.close()


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(
    path: str,
    device: str = "auto",
    dtype: str | None = None,
    model_impl: str = "auto",
    tensor_parallel_size: int = 1,
    distributed_init: str | None = None,
) -> LoadedModel:
    """Load from a local directory or a hub id: bf16 on CUDA, fp32 on the CPU, unless `dtype` says otherwise;
    `model_impl`: auto (native where the architecture has a family and the directory safetensors), native or
    transformers. With `tensor_parallel_size` N > 1, a native model split across N ranks (this process is
    rank 0), which meet at `distributed_init` (tcp://host:port; None: a free loopback port)."""
    if tensor_parallel_size > 1:
        return _load_split(path, device, dtype, model_impl, tensor_parallel_size, distributed_init)
    target = pick_device(device)
    chosen = _dtype(dtype, target)
    pooling = Pooling.of_model(str(path))
    config = AutoConfig.from_pretrained(path)
    if _is_vision(config):
        _no_native_vision(model_impl, config)
        from transformers import AutoModelForImageTextToText, AutoProcessor  # processors import transformers' modeling

        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=chosen).to(target).eval()
        return _loaded(model, processor.tokenizer, target, model.generation_config, processor, pooling=pooling)
    tokenizer = AutoTokenizer.from_pretrained(path)
    family = _native(config, model_impl, path)
    if family is not None:
        return _native_loaded(family, config, tokenizer, path, target, chosen, pooling, SINGLE)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen).to(target).eval()
    return _loaded(model, tokenizer, target, model.generation_config, pooling=pooling)


def random_model(
    config: transformers.PretrainedConfig,
    tokenizer,
    device: str = "auto",
    dtype: str | None = None,
    processor=None,
    model_impl: str = "auto",
):
    """A randomly initialised model of `config`, for timing where no weights are at hand, and for tests
    (a vision-language model's config takes its `processor`, whose tokenizer is `tokenizer`). The weights are
    transformers' initialisation, so a native model has those a transformers one of the same seed has."""
    target = pick_device(device)
    chosen = _dtype(dtype, target)
    vision = _is_vision(config)
    if vision:
        _no_native_vision(model_impl, config)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device(target):  # a copy of the config: the engine sets its attention on the model's own
        model = auto.from_config(copy.deepcopy(config), dtype=chosen).eval()
    family = None if vision else _native(config, model_impl, None)
    if family is not None:
        native = family(copy.deepcopy(config), target, chosen)
        load_tensors(native, model.state_dict().items(), f"a random {config.model_type}")
        model, generation = native, model.generation_config
    else:
        generation = model.generation_config
    return _loaded(model, tokenizer, target, generation, processor, pooling=Pooling())


def _load_split(path, device, dtype, model_impl, size, distributed_init) -> LoadedModel:
    """Rank 0 of a model split across `size` ranks: checked here, before any rank starts."""
    if model_impl == "transformers":
        raise ValueError(
            "--tensor-parallel-size splits the native model code's families: not --model-impl transformers"
        )
    config = AutoConfig.from_pretrained(path)
    if _is_vision(config):
        raise ValueError(f"--tensor-parallel-size: {config.model_type} is a vision-language model, which is not split")
    family = _native(config, "native", path)  # or the error of a model with no family, or no local safetensors
    shape, parallel = Shape.of(config, **family.options(config)), TensorParallel(0, size)
    parallel.split(shape.heads, "attention heads")  # what does not divide is an error for every rank
    parallel.split(shape.intermediate, "MLP intermediate size")
    parallel.kv_heads(shape.kv_heads)
    parallel.vocabulary(shape.vocab)
    from workers.engine import ranks

    target = pick_device(device)
    started = ranks.start(size, distributed_init, path, target, dtype)
    try:
        loaded = load_shard(path, ranks.rank_device(target, 0), dtype, started.parallel)
    except BaseException:
        started.close()
        raise
    return replace(loaded, ranks=started)


def load_shard(path: str, device: torch.device, dtype: str | None, parallel: TensorParallel) -> LoadedModel:
    """This rank's share of a native model (the group of ranks already joined)."""
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pooling = Pooling.of_model(str(path))
    return _native_loaded(
        native_family(config), config, tokenizer, path, device, _dtype(dtype, device), pooling, parallel
    )


def _native_loaded(family, config, tokenizer, path, device, dtype, pooling, parallel) -> LoadedModel:
    if device.type == "cpu":  # before the weights: each tensor read is freed, and its memory reused by the next
        keep_freed_memory()
    model = family(config, device, dtype, parallel)
    load_checkpoint(model, Path(path))
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # none saved: transformers derives it from the model's config, as here
        generation = GenerationConfig.from_model_config(config)
    return replace(_loaded(model, tokenizer, device, generation, pooling=pooling), parallel=parallel)


def _dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    return DTYPES[dtype] if dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)


def _native(config, model_impl: str, path: str | None) -> type[CausalLM] | None:
    """The native family to load `config`'s model with, or None for transformers' (`path`: None for weights
    at hand, else where the safetensors must be)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl {model_impl!r} is none of {', '.join(MODEL_IMPLS)}")
    if model_impl == "transformers":
        return None
    family = native_family(config)
    local = path is None or (Path(path).is_dir() and bool(checkpoint_files(Path(path))))
    if model_impl == "native":
        if family is None:
            named = ", ".join(getattr(config, "architectures", None) or [config.model_type])
            raise ValueError(
                f"--model-impl native: {named} has no native implementation (there are {', '.join(FAMILIES)}); "
                "auto or transformers runs it on transformers"
            )
        if not local:
            raise ValueError(f"--model-impl native loads safetensors from a local directory: {path} has none")
    return family if local else None


def _no_native_vision(model_impl: str, config) -> None:
    if model_impl == "native":
        raise ValueError(
            f"--model-impl native: {config.model_type} is a vision-language model, which runs on transformers "
            "(auto or transformers)"
        )


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
    model, tokenizer, device: torch.device, generation: GenerationConfig | None, processor=None, *, pooling
) -> LoadedModel:
    if device.type == "cpu":
        keep_freed_memory()
    config = model.config.get_text_config()
    eos = generation.eos_token_id if generation else None
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
