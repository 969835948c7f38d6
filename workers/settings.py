"""A worker's settings: who it is on the bus, and which model it runs.

A light module (no torch), so that a command's settings are built and checked
(tokenrelay/settings.py), and sent to serve's engine process, before the
model's libraries are imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.simulated.profile import Profile


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    topic_prefix: str = "tokenrelay"
    partitions: int = 8  # per request topic: up to this many workers share a priority
    heartbeat_interval_s: float = 1.0
    engine_stuck_s: float = 300.0  # an engine step running longer stops the worker; 0: never


@dataclass(frozen=True)
class ModelSettings:
    """The model a worker runs, and the names clients call it by (aliases of each other)."""

    served_names: tuple[str, ...]
    path: str = ""  # a Hugging Face model directory or hub id
    device: str = "auto"  # auto (CUDA if available), cpu, cuda or cuda:N
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on the CPU
    model_impl: str = "auto"  # native (the engine's own model code), transformers, or auto: native where it can
    tensor_parallel_size: int = 1  # ranks the model is split across, one process per device
    distributed_init: str | None = None  # where the ranks meet, tcp://host:port; None: a free loopback port
    adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) of each LoRA adapter served from the start
    simulate: Profile | None = None  # a step-time profile (workers/simulated/) to run instead: no weights, no torch
