"""A LoRA adapter as PEFT saves it, read and checked without torch: by gateways before a load, by workers before theirs.

PEFT's format is a directory of `adapter_config.json` (r, lora_alpha,
use_rslora, target_modules, ...) and `adapter_model.safetensors`, whose
tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`:
A is [r, inputs], B [outputs, r]. The safetensors header is JSON: its shapes
are read from it, not from the tensors, so a gateway checks an adapter
against the model its workers announce (ServedModel.lora) without loading
a byte of weights. Every refusal names its reason, and becomes a 400.
What the engine serves of PEFT's options: plain LoRA on any of the attention
and MLP projections, one rank and alpha for all of them, scaled by
alpha / r, or alpha / sqrt(r) with rsLoRA, as PEFT computes it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, with the block of the decoder layer they belong to.
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_HEADER_BYTES = 100 * 2**20


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


class LoraSupport(BaseModel):
    """What a model's workers take of adapters, as they announce it (ServedModel.lora)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rank: int  # --max-lora-rank
    layers: int
    modules: dict[str, tuple[int, int]]  # projection -> (inputs, outputs) of the whole model's


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's config and the shapes of its tensors: what checking and loading it needs."""

    path: Path
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    shapes: dict[tuple[int, str, str], tuple[int, ...]]  # (layer, module, "A" or "B") -> shape

    @property
    def scaling(self) -> float:
        """What B·A is multiplied by, as PEFT's LoraLayer computes it."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def tensor_names(self) -> dict[tuple[int, str, str], str]:
        return {key: _tensor_name(*key) for key in self.shapes}


def _tensor_name(layer: int, module: str, matrix: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}.lora_{matrix}.weight"


def read_adapter(path: str | Path, max_rank: int) -> AdapterSpec:
    """The adapter in directory `path`; AdapterError if it is malformed, or of a rank above `max_rank`."""
    path = Path(path)
    config = _config(path)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter at {path}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter at {path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter at {path}: its rank r={rank} is above this model's limit {max_rank} (--max-lora-rank)"
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"adapter at {path}: lora_alpha must be a number, got {alpha!r}")
    for option, served in (("bias", "none"), ("use_dora", False), ("modules_to_save", None), ("rank_pattern", {})):
        if config.get(option, served) not in (served, None, {}, []):
            raise AdapterError(f"adapter at {path}: {option}={config[option]!r} is not served (only {served!r})")
    if config.get("alpha_pattern") or config.get("layers_to_transform") is not None:
        raise AdapterError(f"adapter at {path}: alpha_pattern and layers_to_transform are not served")
    targets = _targets(path, config.get("target_modules"))
    shapes = _shapes(path)
    for (layer, module, matrix), shape in shapes.items():
        if module not in targets:
            raise AdapterError(f"adapter at {path}: a tensor for {module}, which target_modules does not name")
        if len(shape) != 2 or shape[0 if matrix == "A" else 1] != rank:
            raise AdapterError(
                f"adapter at {path}: lora_{matrix} of layer {layer}'s {module} is {list(shape)}, not rank {rank}"
            )
    if not shapes:
        raise AdapterError(f"adapter at {path}: {WEIGHTS_FILE} holds no LoRA weights of the decoder layers")
    return AdapterSpec(path, rank, float(alpha), bool(config.get("use_rslora", False)), targets, shapes)


def check_fits(spec: AdapterSpec, support: LoraSupport) -> None:
    """AdapterError unless every tensor of `spec` fits a projection of the model `support` describes."""
    if spec.rank > support.max_rank:
        raise AdapterError(
            f"adapter at {spec.path}: its rank r={spec.rank} is above this model's limit {support.max_rank}"
        )
    missing = sorted(set(spec.targets) - set(support.modules))
    if missing:
        raise AdapterError(f"adapter at {spec.path}: the model has no {', '.join(missing)} to adapt")
    for (layer, module, matrix), shape in spec.shapes.items():
        if layer >= support.layers:
            raise AdapterError(
                f"adapter at {spec.path}: a tensor for layer {layer}; the model has {support.layers} layers"
            )
        inputs, outputs = support.modules[module]
        expected = (spec.rank, inputs) if matrix == "A" else (outputs, spec.rank)
        if tuple(shape) != expected:
            raise AdapterError(
                f"adapter at {spec.path}: lora_{matrix} of layer {layer}'s {module} is {list(shape)}; "
                f"the model's {module} takes {list(expected)}"
            )


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"no adapter directory at {path}")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter at {path}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"adapter at {path}: {CONFIG_FILE} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter at {path}: {CONFIG_FILE} is not a JSON object")
    return config


def _targets(path: Path, named) -> tuple[str, ...]:
    if named == "all-linear":
        return tuple(MODULES)
    names = [named] if isinstance(named, str) else named
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise AdapterError(f"adapter at {path}: target_modules must name projections, got {named!r}")
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        raise AdapterError(
            f"adapter at {path}: target_modules {', '.join(unknown)} are not served; an adapter may target "
            f"{', '.join(MODULES)}"
        )
    return tuple(n for n in MODULES if n in names)


def _shapes(path: Path) -> dict[tuple[int, str, str], tuple[int, ...]]:
    """The LoRA tensors' shapes, from the safetensors header (8 bytes of its length, then JSON)."""
    file = path / WEIGHTS_FILE
    try:
        with file.open("rb") as weights:
            (length,) = struct.unpack("<Q", weights.read(8))
            if length > _MAX_HEADER_BYTES:
                raise AdapterError(f"adapter at {path}: {WEIGHTS_FILE} has a header of {length} bytes")
            header = json.loads(weights.read(length))
    except FileNotFoundError:
        raise AdapterError(f"adapter at {path}: no {WEIGHTS_FILE}") from None
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"adapter at {path}: {WEIGHTS_FILE} is not a safetensors file ({error})") from None
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR.match(name)
        if match is None or match[3] not in MODULES or MODULES[match[3]] != match[2]:
            raise AdapterError(f"adapter at {path}: tensor {name!r} is not a LoRA weight of a served projection")
        shapes[int(match[1]), match[3], match[4]] = tuple(entry.get("shape", ()))
    for layer, module, matrix in list(shapes):
        if (layer, module, "B" if matrix == "A" else "A") not in shapes:
            raise AdapterError(f"adapter at {path}: layer {layer}'s {module} has lora_{matrix} without its pair")
    return shapes
