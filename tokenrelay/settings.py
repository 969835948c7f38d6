"""What a command's flags become: the settings of each part of the process, built and checked in one place.

`settings_of(parse_args(argv, environ))` is the whole of a command's
configuration. Every flag a command takes (tokenrelay/flags/) lands in one
field here, so a flag that a command accepts always does something there
(tests/test_settings.py walks them all). The settings are plain dataclasses
of light modules: `serve` hands its engine process the worker's part of them,
pickled, instead of argv to parse again. A MindIE config.json given with
--mindie-config is read first, as the flags its keys mean, beneath those given.

What cannot be had (a profile that does not exist, a TLS key without its
certificate, a metrics address without a port) raises CannotStart: one line,
exit 1, before anything is loaded. A model directory is looked for when it
is loaded (tokenrelay/worker_parts.py): it may be a volume that is mounted
only where the worker runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bus.settings import InProcessSettings, KafkaSettings
from gateway.settings import GatewaySettings, MediaPolicy, ServerSettings
from gateway.tenancy.tenants import TenantsFileError, read_tenants_file
from tokenrelay.flags.commands import parse_args
from tokenrelay.lifecycle import CannotStart
from tokenrelay.mindie_config import with_mindie_config
from workers.bundled import BUNDLED_MODEL, BUNDLED_MODEL_NAME, BUNDLED_VISION_MODEL, BUNDLED_VISION_MODEL_NAME
from workers.engine.config import EngineConfig
from workers.settings import ModelSettings, WorkerSettings
from workers.simulated.profile import Profile


@dataclass(frozen=True)
class Settings:
    """A process's parts, each with its settings; None where the command has no such part."""

    command: str  # serve, gateway, worker or simulate
    log_level: str
    drain_timeout_s: float
    bus: InProcessSettings | KafkaSettings
    server: ServerSettings | None = None  # serve, gateway: the HTTP server
    gateway: GatewaySettings | None = None  # serve, gateway: its service on the bus
    worker: WorkerSettings | None = None  # serve, worker, simulate (simulate's workers are <worker_id>-<i>)
    model: ModelSettings | None = None
    engine: EngineConfig | None = None
    workers: int = 1  # simulated workers in this process
    metrics_address: str = ""  # worker, simulate: HOST:PORT of GET /metrics; empty: none
    log_format: str | None = None  # json or console; None: console where stderr is a terminal, else json

    def engine_process(self) -> Settings:
        """What serve's engine process needs: its worker's part, and no gateway secrets."""
        return replace(self, server=None, gateway=None)


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings of the command `args` (from parse_args) describes: serve, gateway, worker or simulate."""
    if getattr(args, "mindie_config", ""):
        args = with_mindie_config(args)
    serving = args.command in ("serve", "gateway")
    working = args.command in ("serve", "worker", "simulate")
    return Settings(
        command=args.command,
        log_level=args.log_level,
        log_format=args.log_format,
        drain_timeout_s=args.drain_timeout,
        bus=_kafka(args) if args.command != "serve" else InProcessSettings(args.max_message_bytes),
        server=_server(args) if serving else None,
        gateway=_gateway(args) if serving else None,
        worker=_worker(args) if working else None,
        model=_model(args) if working else None,
        engine=_engine(args) if working else None,
        workers=_simulated_workers(args) if args.command == "simulate" else 1,
        metrics_address=_address(args.metrics_address) if args.command in ("worker", "simulate") else "",
    )


def settings_from(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of a command line and environment (default: this process's), as the process they start
    would read them."""
    return settings_of(parse_args(argv, environ))


def _kafka(args: argparse.Namespace) -> KafkaSettings:
    group = {}  # a worker's consumer group; gateways join none
    if args.command in ("worker", "simulate"):
        group = {
            "session_timeout_ms": args.kafka_session_timeout_ms,
            "heartbeat_interval_ms": args.kafka_heartbeat_interval_ms,
            "max_poll_interval_ms": args.kafka_max_poll_interval_ms,
        }
    return KafkaSettings(
        bootstrap_servers=args.kafka_bootstrap,
        replication_factor=args.kafka_replication_factor,
        publish_timeout_s=args.kafka_publish_timeout,
        max_message_bytes=args.max_message_bytes,
        **group,
    )


def _server(args: argparse.Namespace) -> ServerSettings:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CannotStart("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise CannotStart("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
    return ServerSettings(
        host=args.host,
        port=args.port,
        max_request_bytes=args.max_request_length * 1024 * 1024,
        api_keys=tuple(args.api_keys),
        api_keys_file=args.api_keys_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        media=MediaPolicy(
            media_dir=Path(args.media_dir), allowed_domains=MediaPolicy.parse_domains(args.allowed_media_domains)
        ),
    )


def _gateway(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        topic_prefix=getattr(args, "topic_prefix", GatewaySettings.topic_prefix),  # serve: its own process's topics
        gateway_id=args.gateway_id,
        default_model=args.default_model,
        full_text=args.full_text_enabled,
        default_timeout_s=args.request_timeout,
        max_in_flight=args.max_in_flight,
        max_waiting_requests=args.max_waiting_requests,
        route=not args.no_router,
        reject_unknown_fields=args.reject_unknown_fields,
        admin_api_keys=tuple(key.strip() for key in args.admin_api_keys if key.strip()),
        lora_root=_lora_root(args.lora_root),
        tenants_file=_tenants_file(args.tenants_file),
    )


def _tenants_file(path: str) -> str:
    """--tenants-file, read once here so that a bad one stops the command at once, naming what is wrong."""
    if path:
        try:
            read_tenants_file(path)
        except TenantsFileError as error:
            raise CannotStart(f"--tenants-file {error}") from None
    return path


def _lora_root(root: str) -> str:
    """--lora-root, resolved (symbolic links and all), so that an adapter's resolved path is compared with it."""
    if root and not Path(root).is_dir():
        raise CannotStart(f"--lora-root {root}: no such directory")
    return os.path.realpath(root) if root else ""


def _worker(args: argparse.Namespace) -> WorkerSettings:
    fleet = {}  # serve's one worker shares no topic and is heard by its own process only
    if args.command != "serve":
        fleet = {
            "topic_prefix": args.topic_prefix,
            "partitions": args.partitions,
            "heartbeat_interval_s": args.heartbeat_interval,
        }
    return WorkerSettings(
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        engine_stuck_s=args.engine_stuck_timeout,
        **fleet,
    )


def _model(args: argparse.Namespace) -> ModelSettings:
    names = tuple(args.served_model_name or ())
    if getattr(args, "simulate", ""):
        try:
            profile = Profile.load(args.simulate)
        except ValueError as error:
            raise CannotStart(f"--simulate: {error}") from None
        return ModelSettings(served_names=names or (profile.name,), simulate=profile, adapters=_adapters(args.lora))
    path, name = args.model, args.model
    if args.model == str(BUNDLED_MODEL) and args.vision:
        path, name = str(BUNDLED_VISION_MODEL), BUNDLED_VISION_MODEL_NAME
    elif args.model == str(BUNDLED_MODEL):
        name = BUNDLED_MODEL_NAME
    elif args.vision:
        raise CannotStart(f"--vision serves the bundled vision-language model, not --model {args.model}")
    return ModelSettings(
        served_names=names or (name,),
        path=path,
        device=_device(args.device),
        dtype=args.dtype or None,
        model_impl=args.model_impl,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init=args.distributed_init or None,
        adapters=_adapters(args.lora),
    )


def _device(device: str) -> str:
    """--device: what torch runs the model on here. An NPU (Ascend's) is refused now, not once the model has loaded."""
    if device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device):
        return device
    raise CannotStart(
        f"--device {device}: tokenrelay runs on NVIDIA GPUs with CUDA (cuda, cuda:N) and on any CPU (cpu), auto "
        "taking CUDA where there is one; not on Ascend NPUs or other devices"
    )


def _adapters(named: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=PATH, each a directory."""
    adapters = {}
    for value in named:
        name, equals, path = value.partition("=")
        if not (equals and name and path):
            raise CannotStart(f"--lora {value!r} is not NAME=PATH")
        if name in adapters:
            raise CannotStart(f"--lora names adapter {name} twice")
        if not Path(path).is_dir():
            raise CannotStart(f"--lora {value}: no directory {path}")
        adapters[name] = str(Path(path).resolve())
    return tuple(adapters.items())


def _engine(args: argparse.Namespace) -> EngineConfig:
    loaded = {}  # what only a loaded model has: a simulated one has neither memory nor graphs
    if args.command != "simulate":
        loaded = {
            "kv_cache_bytes": int(args.kv_cache_memory * 2**30) or None,
            "gpu_memory_fraction": args.gpu_memory_fraction,
            "cuda_graphs": not args.no_cuda_graphs,
            **_speculation(args),
        }
    return EngineConfig(
        max_batch_size=args.max_batch_size or None,
        max_seq_len=args.max_seq_len,
        max_input_len=args.max_input_len,
        max_iter_times=args.max_iter_times,
        max_tokens_per_step=args.max_tokens_per_step or None,
        block_size=args.block_size,
        aging_s=args.priority_aging,
        **_lora_slots(args),
        **loaded,
    )


def _speculation(args: argparse.Namespace) -> dict:
    if not 1 <= args.num_speculative_tokens <= 16:
        raise CannotStart(f"--num-speculative-tokens {args.num_speculative_tokens}: from 1 to 16")
    if not 1 <= args.ngram_min <= args.ngram_max <= 16:
        raise CannotStart(
            f"--ngram-min {args.ngram_min}, --ngram-max {args.ngram_max}: 1 <= --ngram-min <= --ngram-max <= 16"
        )
    method = args.speculative
    if args.speculative_model:
        if args.speculative:
            raise CannotStart(
                f"--speculative {args.speculative} and --speculative-model: one way of proposing, not two"
            )
        if not Path(args.speculative_model).is_dir():
            raise CannotStart(f"--speculative-model {args.speculative_model}: no such directory")
        if args.tensor_parallel_size > 1:
            raise CannotStart(
                "--speculative-model: a draft model is not served beside a split one (--tensor-parallel-size)"
            )
        method = "draft"
    if method and getattr(args, "simulate", ""):
        raise CannotStart("--speculative, --speculative-model: a simulated model's tokens are a formula, not computed")
    return {
        "speculative": method,
        "speculative_model": str(Path(args.speculative_model).resolve()) if args.speculative_model else None,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_always": args.speculative_always,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
    }


def _lora_slots(args: argparse.Namespace) -> dict:
    for flag, value, lowest in (("--max-loras", args.max_loras, 0), ("--max-cpu-loras", args.max_cpu_loras, 0)):
        if value < lowest:
            raise CannotStart(f"{flag} {value}: at least {lowest}")
    if not 1 <= args.max_lora_rank <= 512:
        raise CannotStart(f"--max-lora-rank {args.max_lora_rank}: from 1 to 512")
    slots = args.max_loras or (4 if args.lora else 0)
    return {"max_loras": slots, "max_cpu_loras": args.max_cpu_loras or None, "max_lora_rank": args.max_lora_rank}


def _address(address: str) -> str:
    """HOST:PORT (HOST may be empty: every address), or empty."""
    host, colon, port = address.rpartition(":")
    if address and not (colon and port.isdigit() and 0 < int(port) < 65536):
        raise CannotStart(f"--metrics-address {address!r} is not HOST:PORT (a port from 1 to 65535)")
    return address


def _simulated_workers(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise CannotStart(f"--workers {args.workers}: at least 1")
    return args.workers
