"""The `tokenrelay` command.

    tokenrelay serve     gateway + worker + in-process bus, one process, no broker
    tokenrelay gateway   an HTTP/WebSocket gateway on Kafka
    tokenrelay worker    a model worker on Kafka
    tokenrelay simulate  many simulated workers in one process, on Kafka
    tokenrelay up        gateways and workers on one Kafka, on this machine
    tokenrelay bench     benchmarks (engine, serve, chaos, scale, priority, profile)

Every flag can also come from the environment: `--served-model-name` is
`TOKENRELAY_SERVED_MODEL_NAME` (lists separated by commas). A flag given on
the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import logging
import os
import signal
import socket
import ssl
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
import structlog
import uvicorn

from bus.base import Bus
from bus.inprocess import InProcessBus
from bus.kafka import KafkaBus, KafkaSettings
from bus.local import LocalBus
from gateway.api_keys import load_keys
from gateway.app import create_app
from gateway.media import MediaLoader, MediaPolicy
from gateway.service import GatewayService, GatewaySettings
from tokenrelay import logs, topology
from tokenrelay.engine_process import EngineProcess, ignore_signals
from workers.bundled import (
    BUNDLED_MODEL,
    BUNDLED_MODEL_NAME,
    BUNDLED_VISION_MODEL,
    BUNDLED_VISION_MODEL_NAME,
    DTYPE_NAMES,
)
from workers.simulated.profile import names as simulation_profiles

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Model
    from workers.worker import Worker

# torch and transformers are imported only where a model runs (serve, worker,
# bench engine): a gateway starts in a second instead of fifteen.
log = structlog.get_logger("tokenrelay")


def _env_name(flag: str) -> str:
    return "TOKENRELAY_" + flag.lstrip("-").replace("-", "_").upper()


def _option(parser: argparse.ArgumentParser, flag: str, *, help: str, env: str = "", **kwargs) -> None:
    """A flag whose default may come from TOKENRELAY_<FLAG> (or the variable named by `env`)."""
    env = env or _env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = value.split(",") if kwargs.get("nargs") == "+" else value
        kwargs.pop("required", None)
    default = kwargs.get("default")
    shown = f"; default {default}" if default not in (None, "") else ""
    parser.add_argument(flag, help=f"{help} (env {env}{shown})", **kwargs)


def _common_options(parser: argparse.ArgumentParser) -> None:
    _option(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    _option(parser, "--topic-prefix", default="tokenrelay", help="prefix of every topic name")


def _gateway_options(parser: argparse.ArgumentParser) -> None:
    _option(parser, "--host", default="127.0.0.1", help="address to listen on")
    _option(parser, "--port", type=int, default=1025, help="port to listen on (MindIE's is 1025)")
    _option(parser, "--gateway-id", default="", help="this gateway's id, which names its reply topic; empty: random")
    _option(parser, "--default-model", default="", help="the model of /infer_token and /infer; empty: the only one")
    _option(
        parser,
        "--full-text-enabled",
        action="store_true",
        default=False,
        help="stream events carry the text so far instead of the new piece (fullTextEnabled)",
    )
    _option(
        parser,
        "--max-request-length",
        type=int,
        default=40,
        help="largest request body in MB; larger ones get 413 (maxRequestLength)",
    )
    _option(
        parser,
        "--max-in-flight",
        type=int,
        default=4096,
        help="requests this gateway waits for at once; beyond that, 429 with Retry-After",
    )
    _option(
        parser,
        "--media-dir",
        default="/data/multimodal_inputs",
        help="the only directory multimodal input may read local files from",
    )
    _option(
        parser,
        "--no-router",
        action="store_true",
        default=False,
        help="publish every request to the request topics that workers share, instead of routing it to the "
        "worker with room and its prompt cached (the placement before routing; for comparisons)",
    )
    _option(parser, "--api-keys", nargs="+", default=[], help="API keys clients must send (Bearer); none: open")
    _option(parser, "--api-keys-file", default="", help="a file of API keys, one per line (with --api-keys, all count)")
    _option(parser, "--tls-cert", default="", help="PEM certificate chain: serve https (with --tls-key)")
    _option(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    _option(parser, "--tls-ca", default="", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    _option(
        parser,
        "--allowed-media-domains",
        default="",
        env="ALLOWED_MEDIA_DOMAINS_ENV",
        help="comma-separated hosts multimodal input may fetch http(s) URLs from",
    )


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _worker_options(parser: argparse.ArgumentParser) -> None:
    _option(
        parser,
        "--model",
        default=str(BUNDLED_MODEL),
        help="Hugging Face causal-LM or vision-language model (LLaVA, Qwen2-VL, ...) directory or hub id; "
        "default: the bundled model",
    )
    _option(
        parser,
        "--vision",
        action="store_true",
        help=f"serve the bundled vision-language model ({BUNDLED_VISION_MODEL_NAME}) instead of the bundled text one",
    )
    _option(
        parser,
        "--served-model-name",
        nargs="+",
        default=None,
        help=f"names clients use for the model, aliases of each other; "
        f"default: {BUNDLED_MODEL_NAME} for the bundled model, else --model",
    )
    _option(parser, "--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    dtypes = ["", *DTYPE_NAMES]
    _option(parser, "--dtype", default="", choices=dtypes, help="model dtype; empty: bf16 on CUDA, fp32 on CPU")
    _option(
        parser,
        "--max-batch-size",
        type=int,
        default=0,
        help="sequences that run at once (maxBatchSize); 0: 64 on the CPU, 256 on a GPU",
    )
    _option(parser, "--max-seq-len", type=int, default=2560, help="prompt + generated tokens (maxSeqLen)")
    _option(parser, "--max-input-len", type=int, default=2048, help="prompt tokens (maxInputTokenLen)")
    _option(parser, "--max-iter-times", type=int, default=512, help="generated tokens per request (maxIterTimes)")
    _option(
        parser,
        "--max-tokens-per-step",
        type=int,
        default=0,
        help="tokens one engine step computes: a token per decoding sequence, the rest on prompt chunks; "
        "0: 1024 on the CPU, 2048 on a GPU",
    )
    _option(parser, "--block-size", type=int, default=32, help="tokens per KV cache block")
    _option(
        parser,
        "--kv-cache-memory",
        type=float,
        default=0.0,
        help="GiB for the KV cache; 0: 1 GiB on the CPU, --gpu-memory-fraction on a GPU",
    )
    _option(
        parser,
        "--gpu-memory-fraction",
        type=_fraction,
        default=0.9,
        help="share of the GPU memory left after the weights, the largest step's work and the CUDA graphs "
        "that the KV cache takes, in (0, 1]",
    )
    _option(
        parser,
        "--no-cuda-graphs",
        action="store_true",
        default=False,
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only)",
    )
    _option(
        parser,
        "--priority-aging",
        type=float,
        default=10.0,
        help="seconds of waiting that make a request one priority level more urgent",
    )
    _option(parser, "--worker-id", default="", help="this worker's id in heartbeats and logs; empty: host-pid")
    _option(
        parser,
        "--partitions",
        type=int,
        default=8,
        help="partitions of each request topic created here: at most this many workers share a priority",
    )
    _option(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between worker heartbeats")
    _option(
        parser,
        "--simulate",
        default="",
        help="simulate the model with a step-time profile (a file, or one of "
        f"{', '.join(simulation_profiles())}): no weights, no torch; empty: run --model",
    )


def _bus_options(parser: argparse.ArgumentParser) -> None:
    _option(
        parser,
        "--max-message-bytes",
        type=int,
        default=16 * 2**20,
        help="largest message the bus carries, on Kafka (its producer, the topics created, the fetches) and in "
        "process alike: a request larger on the bus (its images count) is answered 413 before it is published",
    )


def _kafka_options(parser: argparse.ArgumentParser) -> None:
    _option(parser, "--kafka-bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    _option(parser, "--kafka-replication-factor", type=int, default=1, help="replication of the topics created here")
    _option(
        parser,
        "--kafka-session-timeout-ms",
        type=int,
        default=6_000,
        help="workers: how long the group waits for a silent member before its partitions move "
        "(a dead worker's unread requests wait this long)",
    )
    _option(
        parser,
        "--kafka-publish-timeout",
        type=float,
        default=1.5,
        help="seconds a message may take to reach the broker; after that the publisher gives up "
        "(a gateway answers 503)",
    )
    _option(parser, "--kafka-heartbeat-interval-ms", type=int, default=1_000, help="workers: group heartbeat period")
    _option(
        parser,
        "--kafka-max-poll-interval-ms",
        type=int,
        default=60_000,
        help="workers: longest pause between polls before the member is dropped",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenrelay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="gateway and worker in one process, in-process bus")
    gateway = commands.add_parser("gateway", help="an HTTP/WebSocket gateway on Kafka")
    worker = commands.add_parser("worker", help="a model worker on Kafka")
    simulate = commands.add_parser(
        "simulate",
        help="many simulated workers in one process, on Kafka",
        description="Run --workers workers in one process, each the real worker and engine around a "
        "simulated model (--simulate, default bundled-cpu): steps take the profile's time and tokens "
        "come from each request's seed. A fleet on one machine, for `tokenrelay bench scale`.",
    )
    _option(simulate, "--workers", type=int, default=8, help="simulated workers")
    up = commands.add_parser(
        "up",
        help="gateways and workers on one Kafka, on this machine, to try out",
        description="Start --workers workers and --gateways gateways on one Kafka (a local broker from "
        "deploy/kafka/ unless --kafka-bootstrap is given), the gateways on consecutive ports from --port "
        "(1025, 1026, ...: no load balancer in front; point clients at any of them). Stops them all on "
        "SIGINT/SIGTERM, or when one of them dies.",
    )
    _common_options(up)
    _option(up, "--gateways", type=int, default=1, help="gateway processes")
    _option(up, "--workers", type=int, default=2, help="worker processes")
    _option(up, "--host", default="127.0.0.1", help="address the gateways listen on")
    _option(up, "--port", type=int, default=1025, help="the first gateway's port; the others follow it")
    _option(up, "--kafka-bootstrap", default="", help="Kafka bootstrap servers; empty: start a local broker")
    _option(
        up,
        "--kafka-brokers",
        type=int,
        default=1,
        help="brokers of the local Kafka: 1, or 3 or more for a replicated cluster that loses nothing when a "
        "broker dies (topics replicated min(N, 3) times, min.insync.replicas 2; with --kafka-bootstrap: "
        "that cluster's brokers)",
    )
    _option(up, "--worker-args", default="", help="more flags for every worker, as one string")
    _option(up, "--gateway-args", default="", help="more flags for every gateway, as one string")
    _option(up, "--log-dir", default="", help="where each process logs; empty: a temporary directory")
    bench = commands.add_parser(
        "bench",
        help="benchmarks: `tokenrelay bench {engine,serve,chaos,rolling,scale,priority,profile} --help`",
        add_help=False,
    )
    bench.add_argument("benchmark", choices=["engine", "serve", "chaos", "rolling", "scale", "priority", "profile"])
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    for sub in (serve, gateway, worker, simulate):
        _common_options(sub)
    for sub in (serve, gateway):
        _gateway_options(sub)
    for sub in (serve, worker, simulate):
        _worker_options(sub)
    for sub in (gateway, worker, simulate):
        _kafka_options(sub)
    for sub in (serve, gateway, worker, simulate):
        _bus_options(sub)
    for sub in (serve, gateway, worker, simulate):
        _option(
            sub,
            "--drain-timeout",
            type=float,
            default=30.0,
            help="seconds a SIGTERM/SIGINT leaves running requests to end (new ones are refused, or go to other "
            "workers) before the process hands them over and exits; a second signal stops at once",
        )
    for sub in (worker, simulate):
        _option(
            sub,
            "--metrics-address",
            default="",
            help="HOST:PORT where the worker serves GET /metrics (Prometheus); empty: nowhere",
        )
    return parser


def _kafka_bus(args: argparse.Namespace, client_id: str) -> KafkaBus:
    settings = KafkaSettings(
        bootstrap_servers=args.kafka_bootstrap,
        replication_factor=args.kafka_replication_factor,
        session_timeout_ms=args.kafka_session_timeout_ms,
        heartbeat_interval_ms=args.kafka_heartbeat_interval_ms,
        max_poll_interval_ms=args.kafka_max_poll_interval_ms,
        publish_timeout_s=args.kafka_publish_timeout,
        max_message_bytes=args.max_message_bytes,
    )
    return KafkaBus(settings, client_id=client_id)


def _worker(args: argparse.Namespace, bus: Bus, worker_id: str) -> Worker:
    from workers.worker import Worker, WorkerSettings

    settings = WorkerSettings(
        worker_id=worker_id,
        topic_prefix=args.topic_prefix,
        partitions=args.partitions,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    model, config, names = engine_parts(args)
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

        model = SimulatedModel(Profile.load(args.simulate))
        return model, model.engine_config(config), args.served_model_name or [model.profile.name]
    from workers.engine.model_loader import load_model

    path, name = args.model, args.model
    if args.model == str(BUNDLED_MODEL):
        path, name = (BUNDLED_VISION_MODEL, BUNDLED_VISION_MODEL_NAME) if args.vision else (path, BUNDLED_MODEL_NAME)
    return load_model(str(path), args.device, args.dtype or None), config, args.served_model_name or [name]


def _worker_id(args: argparse.Namespace) -> str:
    return args.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def _http_server(
    args: argparse.Namespace, bus: Bus, more_metrics: Callable[[], Awaitable[bytes]] | None = None
) -> _Server:
    settings = GatewaySettings(
        topic_prefix=args.topic_prefix,
        gateway_id=args.gateway_id,
        default_model=args.default_model,
        full_text=args.full_text_enabled,
        max_in_flight=args.max_in_flight,
        route=not args.no_router,
    )
    media = MediaLoader(
        MediaPolicy(
            media_dir=Path(args.media_dir),
            allowed_domains=MediaPolicy.parse_domains(args.allowed_media_domains),
        )
    )
    service = GatewayService(bus, settings)
    app = create_app(
        service,
        media,
        max_request_bytes=args.max_request_length * 1024 * 1024,
        api_keys=load_keys(args.api_keys, args.api_keys_file),
        more_metrics=more_metrics,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        ws_ping_interval=20.0,  # WebSocket clients are pinged; one silent for 20 s more is closed
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5.0,  # after the drain: only idle connections are left to close
        **_tls(args),
    )
    return _Server(config, service)


def _tls(args: argparse.Namespace) -> dict:
    """uvicorn's TLS settings: https with --tls-cert/--tls-key; client certificates required with --tls-ca."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise SystemExit("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
    if not args.tls_cert:
        return {}
    tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
    if args.tls_ca:
        tls |= {"ssl_ca_certs": args.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: GatewayService) -> None:
        super().__init__(config)
        self.gateway = gateway

    @contextlib.contextmanager
    def capture_signals(self):
        # This process handles SIGINT/SIGTERM itself (see _run), so that it can
        # stop the worker too; uvicorn would re-raise them after its own stop.
        yield


async def _run(
    bus: Bus,
    server: _Server | None,
    workers: list[Worker | EngineProcess],
    drain_timeout_s: float,
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
    started: Callable[[], None] | None = None,
) -> bool:
    """Run the parts until a signal, or until one of them ends; then stop them all.

    A first signal drains them first (at most `drain_timeout_s`), a second one cuts that short.
    `started()` is called once the workers have started. Returns False when a part failed.
    """
    failed = False
    stopping, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_asked() -> None:
        (hurry if stopping.is_set() else stopping).set()

    for sig in signals:
        loop.add_signal_handler(sig, stop_asked)
    if isinstance(bus, LocalBus):  # serve's engine process: its serve process asks, not a signal
        bus.stop_asked = stop_asked
    await bus.start()
    tasks = [asyncio.create_task(stopping.wait(), name="signal")]
    try:
        await asyncio.gather(*(worker.start() for worker in workers))
        if started is not None:
            started()
        tasks += [asyncio.create_task(worker.run(), name="worker") for worker in workers]
        if server is not None:
            tasks.append(asyncio.create_task(server.serve(), name="http"))
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.get_name() != "signal":  # a part that ends by itself has failed
                failed = True
                log.error("part_failed", part=task.get_name(), error=repr(task.exception()))
        if not failed:
            parts = [task for task in tasks if task.get_name() != "signal"]
            failed = not await _drain(server.gateway if server else None, workers, drain_timeout_s, hurry, parts)
    finally:
        if server is not None:
            server.should_exit = True
        stopping = asyncio.create_task(_stop(bus, workers, tasks))
        if not (await asyncio.wait({stopping}, timeout=_STOP_TIMEOUT_S))[0]:
            # Exit anyway (the gateways fail over what a worker still held), and say what did not stop.
            stuck = {t.get_name(): repr(t.get_stack(limit=4)) for t in asyncio.all_tasks() if not t.done()}
            log.error("stop_stuck", seconds=_STOP_TIMEOUT_S, tasks=stuck)
            _exit(not failed)
        log.info("stopped")
    return not failed


async def _stop(bus: Bus, workers: list[Worker | EngineProcess], tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        if task.get_name() != "http":
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(worker.stop() for worker in workers))
    await bus.close()


async def _drain(
    gateway: GatewayService | None,
    workers: list[Worker | EngineProcess],
    timeout_s: float,
    hurry: asyncio.Event,
    parts: list[asyncio.Task],
) -> bool:
    """Refuse new requests, let those in flight end; cut short by a second signal. False if a part failed meanwhile."""
    if gateway is not None:
        gateway.start_draining()
    drains = [worker.drain(timeout_s) for worker in workers] + ([gateway.drained(timeout_s)] if gateway else [])
    draining = asyncio.ensure_future(asyncio.gather(*drains))
    hurried = asyncio.create_task(hurry.wait())
    try:
        done, _ = await asyncio.wait([draining, hurried, *parts], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
        draining.cancel()
        await asyncio.gather(draining, hurried, return_exceptions=True)
    failed = [task for task in done if task in parts]
    for task in failed:
        log.error("part_failed", part=task.get_name(), error=repr(task.exception()))
    if draining in done and draining.exception() is not None:
        log.error("drain_failed", error=repr(draining.exception()))
        return False
    return not failed


def _engine_main(argv: list[str], socket_path: str) -> None:
    """The engine process of `tokenrelay serve ARGV` (tokenrelay/engine_process.py): its worker, on the serve
    process's bus at `socket_path`."""
    ignore_signals()
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, process="engine")
    for collector in (
        prometheus_client.PROCESS_COLLECTOR,
        prometheus_client.PLATFORM_COLLECTOR,
        prometheus_client.GC_COLLECTOR,
    ):
        prometheus_client.REGISTRY.unregister(collector)  # the serve process's own report these
    bus = LocalBus(socket_path, prometheus_client.generate_latest, args.max_message_bytes, on_lost=lambda: os._exit(1))
    try:
        worker = _worker(args, bus, _worker_id(args))
        ok = asyncio.run(_run(bus, None, [worker], args.drain_timeout, signals=()))
    except Exception:
        log.exception("failed")
        ok = False
    _exit(ok)


_STOP_TIMEOUT_S = 15.0  # after a drain: stopping takes a second or two (an engine process's 10 s kill at most)


def _serve_metrics(address: str) -> None:
    host, _, port = address.rpartition(":")
    prometheus_client.start_http_server(int(port), addr=host or "0.0.0.0")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        logs.configure("warning", process="bench")
        module = f"tokenrelay.bench.{args.benchmark}"
        importlib.import_module(module).main(args.options)
        return
    logs.configure(args.log_level, process=args.command)
    if args.command == "up":
        sys.exit(topology.up(args))
    if args.command == "serve":
        bus: Bus = InProcessBus(args.max_message_bytes)
        engine = EngineProcess(bus, _engine_main, sys.argv[1:] if argv is None else argv)
        parts = (_http_server(args, bus, engine.metrics), [engine])
    elif args.command == "gateway":
        bus = _kafka_bus(args, client_id=f"gateway-{args.gateway_id or uuid.uuid4().hex[:8]}")
        parts = (_http_server(args, bus), [])
    else:
        bus = _kafka_bus(args, client_id=f"worker-{args.worker_id or os.getpid()}")
        if args.command == "worker":
            workers = [_worker(args, bus, _worker_id(args))]
        else:  # simulate: one bus (producer, admin client) for every worker of the process
            args.simulate = args.simulate or "bundled-cpu"
            workers = [_worker(args, bus, f"{_worker_id(args)}-{i}") for i in range(args.workers)]
        parts = (None, workers)
    # A worker's /metrics answers once it has loaded its model and joined its group: a readiness probe.
    started = functools.partial(_serve_metrics, args.metrics_address) if getattr(args, "metrics_address", "") else None
    try:
        ok = asyncio.run(_run(bus, *parts, args.drain_timeout, started=started))
    except Exception:
        log.exception("failed")
        ok = False
    _exit(ok)


def _exit(ok: bool) -> None:
    """Exit now that all is stopped, said and logged: the interpreter's teardown (torch's) would take seconds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
