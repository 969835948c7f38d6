"""A worker as its settings describe it: the model (loaded, or simulated) in its engine, on a bus.

torch and transformers are imported here only when a model is loaded, so that
the processes that load none start in a second; and a process serving a
text-only model never imports torchvision (`_without_torchvision`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tokenrelay.lifecycle import CannotStart

if TYPE_CHECKING:
    from bus.base import Bus
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Model
    from workers.settings import ModelSettings, WorkerSettings
    from workers.worker import Worker

log = structlog.get_logger("tokenrelay")


def build_worker(model: ModelSettings, engine: EngineConfig, worker: WorkerSettings, bus: Bus) -> Worker:
    loaded, config = engine_parts(model, engine)
    from schemas.adapters import AdapterError
    from workers.worker import Worker  # after the model: its line says what the wait is for

    try:
        return Worker(bus, loaded, config, list(model.served_names), worker, dict(model.adapters))
    except AdapterError as error:
        raise CannotStart(f"--lora: {error}") from None


def engine_parts(model: ModelSettings, engine: EngineConfig) -> tuple[Model, EngineConfig]:
    """What a worker's engine runs: the model (loaded, or simulated) and the engine's config for it."""
    if model.simulate is not None:
        from workers.simulated.model import SimulatedModel

        simulated = SimulatedModel(model.simulate)
        return simulated, simulated.engine_config(engine)
    path = model.path
    if path.startswith(("/", ".")) and not Path(path).exists():
        raise CannotStart(f"--model {path}: no such directory")
    began = time.monotonic()
    log.info(
        "loading_model",
        model=path,
        device=model.device,
        model_impl=model.model_impl,
        tensor_parallel_size=model.tensor_parallel_size,
    )
    _without_torchvision(path)
    from workers.engine.model_loader import load_model

    try:
        loaded = load_model(
            path, model.device, model.dtype, model.model_impl, model.tensor_parallel_size, model.distributed_init
        )
    except (OSError, ValueError) as error:  # no such directory or hub id, a file missing; a checkpoint that
        raise CannotStart(f"--model {path}: {error}") from None  # does not fit, a model impl that cannot run it
    log.info(
        "model_loaded",
        model=path,
        seconds=round(time.monotonic() - began, 1),
        implementation=loaded.implementation,
        device=str(loaded.device),
        dtype=str(loaded.model.dtype),
        vocab_size=loaded.vocab_size,
        tensor_parallel_size=loaded.parallel.size,
    )
    return loaded, engine


def _without_torchvision(path: str) -> None:
    """For a text-only model (a directory whose config has no vision_config), have this process see no
    torchvision: transformers imports it wherever it is installed, for image processors, even to read a text
    model's config, and torchvision imports torch._dynamo, seconds of a worker's start. A module set to None
    in sys.modules is one Python reports absent (importlib.util.find_spec) and refuses to import."""
    config = Path(path) / "config.json"
    if "torchvision" in sys.modules or not config.is_file() or "vision_config" in json.loads(config.read_text()):
        return
    sys.modules["torchvision"] = None
