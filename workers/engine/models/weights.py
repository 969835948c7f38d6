"""A native model's weights, straight from a checkpoint's safetensors files into its parameters.

Single files and sharded checkpoints (model.safetensors.index.json) are
read through safetensors' memory map, tensor by tensor: each is copied into
its place in the model's parameters (layers.CausalLM.checkpoint_tensors; a
fused projection's parts are views of its one weight), converted to the
model's dtype and moved to its device on the way, so that no second copy of
the model is ever held. A tensor-parallel rank reads only its part of each
tensor (a slice of the memory map), so that no rank holds the whole model;
what its loading took at its peak is logged. Anything that does not fit is
one error naming the tensor and the file: a tensor missing, one the model
has no place for, one of the wrong shape.
"""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from workers.engine.models.layers import CausalLM, Slot

log = structlog.get_logger(__name__)
_GIB = 2**30

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config's model."""


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: its index's shards, or its single file; [] if none."""
    index = directory / INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0]} is not in {directory}")
        return [directory / name for name in shards]
    return sorted(directory.glob("*.safetensors"))


def load_checkpoint(model: CausalLM, directory: Path) -> None:
    files = checkpoint_files(directory)
    if not files:
        raise CheckpointError(f"{directory} has no safetensors files")
    device = model.embed_tokens.weight.device
    if device.type == "cuda":  # safetensors places each tensor on the GPU itself; on the CPU, from the memory map
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    targets = model.checkpoint_tensors()
    before = _resident_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as file:
            names = list(file.keys())
            tensors = ((name, file.get_slice(name).get_shape(), _reader(path, device, name)) for name in names)
            _fill(model, targets, path.name, tensors)
    _check_complete(targets, f"{directory}'s safetensors files ({', '.join(p.name for p in files)})")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_resident_bytes() - before
    log.info(
        "weights_loaded",
        rank=model.parallel.rank,
        tensor_parallel_size=model.parallel.size,
        weights_gib=round(weights / _GIB, 3),
        peak_gib=round(peak / _GIB, 3),  # the device's allocations; on the CPU, the process's resident growth
    )


def _resident_bytes() -> int:
    """The process's resident memory now; its peak is counted from here on (Linux: "5" to clear_refs)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        peak = next((line for line in status if line.startswith("VmHWM:")), None)
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return int(peak.split()[1]) * 1024


def _reader(path: Path, device: torch.device, name: str) -> Callable[[Slot], torch.Tensor]:
    """Each tensor through a memory map of its own: the file's pages a read touches are in the process's
    resident memory while they are mapped, so a map held for the whole file would hold all that was read."""

    def read(slot: Slot) -> torch.Tensor:
        with safe_open(str(path), framework="pt", device=str(device)) as file:
            if slot.target.shape == slot.shape:
                return file.get_tensor(name)
            part = slice(slot.start, slot.start + slot.target.shape[slot.dim])
            return file.get_slice(name)[(slice(None),) * slot.dim + (part,)]  # only this part leaves the file

    return read


def load_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """The same from tensors at hand (a transformers model's state dict: a random model's weights)."""
    targets = model.checkpoint_tensors()

    def reader(tensor: torch.Tensor) -> Callable[[Slot], torch.Tensor]:
        return lambda slot: tensor.narrow(slot.dim, slot.start, slot.target.shape[slot.dim])

    _fill(model, targets, source, ((name, list(t.shape), reader(t)) for name, t in tensors))
    _check_complete(targets, source)


def _fill(
    model: CausalLM,
    targets: dict[str, Slot],
    source: str,
    tensors: Iterable[tuple[str, list[int], Callable[[Slot], torch.Tensor]]],
) -> None:
    """Copy each (name, shape, read) into its slot, which leaves `targets` (so that what remains is missing)."""
    architecture = type(model).__name__
    for name, shape, read in tensors:
        slot = targets.pop(name, None)
        if slot is None:
            if model.ignores(name):
                continue
            raise CheckpointError(f"{source}: tensor {name} has no place in {architecture} (or is in two files)")
        if list(shape) != list(slot.shape):
            raise CheckpointError(
                f"{source}: tensor {name} has shape {list(shape)}, where the config's {architecture} "
                f"needs {list(slot.shape)}"
            )
        slot.target.copy_(read(slot))


def _check_complete(targets: dict[str, torch.Tensor], source: str) -> None:
    if targets:
        missing = sorted(targets)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]}{more} is in none of {source}")
