"""A worker as its flags describe it: the model (loaded, or simulated), the engine's config, the served names.

torch and transformers are imported here only when a model is loaded, so that
the processes that load none start in a second.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tokenrelay.lifecycle import CannotStart
from workers.bundled import BUNDLED_MODEL, BUNDLED_MODEL_NAME, BUNDLED_VISION_MODEL, BUNDLED_VISION_MODEL_NAME

if TYPE_CHECKING:
    from bus.base import Bus
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Model
    from workers.worker import Worker

log = structlog.get_logger("tokenrelay")


def worker_id(args: argparse.Namespace) -> str:
    return args.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def build_worker(args: argparse.Namespace, bus: Bus, worker_id: str) -> Worker:
    model, config, names = engine_parts(args)
    from workers.worker import Worker, WorkerSettings  # after the model: its line says what the wait is for

    settings = WorkerSettings(
        worker_id=worker_id,
        topic_prefix=args.topic_prefix,
        partitions=args.partitions,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    return Worker(bus, model, config, names, settings)


def engine_parts(args: argparse.Namespace) -> tuple[Model, EngineConfig, list[str]]:
    """What a worker's engine runs, as a worker's flags say: the model (loaded), its config, its served names."""
    from workers.engine.config import EngineConfig

    config = EngineConfig(
        max_batch_size=args.max_batch_size or None,
        max_seq_len=args.max_seq_len,
        max_input_len=args.max_input_len,
        max_iter_times=args.max_iter_times,
        max_tokens_per_step=args.max_tokens_per_step or None,
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_memory * 2**30) or None,
        gpu_memory_fraction=args.gpu_memory_fraction,
        cuda_graphs=not args.no_cuda_graphs,
        aging_s=args.priority_aging,
    )
    if args.simulate:
        from workers.simulated.model import SimulatedModel
        from workers.simulated.profile import Profile

        try:
            model = SimulatedModel(Profile.load(args.simulate))
        except ValueError as error:
            raise CannotStart(f"--simulate: {error}") from None
        return model, model.engine_config(config), args.served_model_name or [model.profile.name]
    path, name = args.model, args.model
    if args.model == str(BUNDLED_MODEL):
        path, name = (BUNDLED_VISION_MODEL, BUNDLED_VISION_MODEL_NAME) if args.vision else (path, BUNDLED_MODEL_NAME)
    if str(path).startswith(("/", ".")) and not Path(path).exists():
        raise CannotStart(f"--model {path}: no such directory")
    began = time.monotonic()
    log.info("loading_model", model=str(path), device=args.device)
    from workers.engine.model_loader import load_model

    try:
        loaded = load_model(str(path), args.device, args.dtype or None)
    except OSError as error:  # transformers' own words: no such directory or hub id, a file missing
        raise CannotStart(f"--model {path}: {error}") from None
    log.info(
        "model_loaded",
        model=str(path),
        seconds=round(time.monotonic() - began, 1),
        device=str(loaded.device),
        dtype=str(loaded.model.dtype),
        vocab_size=loaded.vocab_size,
    )
    return loaded, config, args.served_model_name or [name]
