"""The flags of every `tokenrelay` command, from the command line and from the environment.

What they become is tokenrelay/settings.py's; each command takes only the
flags that do something there.

Every flag can also come from the environment: `--served-model-name` is
`TOKENRELAY_SERVED_MODEL_NAME` (lists separated by commas, a switch as 1,
true, yes or on). An environment value is read as if its flag came first on
the command line, so it is checked exactly as the flag is (its type, its
choices, its range) and a flag given on the command line wins. Beneath
both lies a MindIE config.json (--mindie-config), whose keys are read as the
flags they mean (tokenrelay/mindie_config.py), so either of those wins over it.

Only the parser is built here: what each command runs (tokenrelay/launch.py
and the modules it imports: uvicorn, FastAPI, aiokafka, torch) is imported
once the command line is parsed, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from workers.bundled import (
    BUNDLED_DRAFT_MODEL,
    BUNDLED_MODEL,
    BUNDLED_MODEL_NAME,
    BUNDLED_VISION_MODEL_NAME,
    DTYPE_NAMES,
    MODEL_IMPLS,
)
from workers.simulated.profile import names as simulation_profiles

_DESCRIPTION = """\
    tokenrelay serve     gateway + worker + in-process bus, one process, no broker
    tokenrelay gateway   an HTTP/WebSocket gateway on Kafka
    tokenrelay worker    a model worker on Kafka
    tokenrelay simulate  many simulated workers in one process, on Kafka
    tokenrelay up        gateways and workers on one Kafka, on this machine
    tokenrelay usage     the usage topic summed per tenant and period
    tokenrelay bench     benchmarks (engine, serve, chaos, rolling, scale, priority, tenants, profile, kernels, shard)

Every flag can also come from the environment: `--served-model-name` is
TOKENRELAY_SERVED_MODEL_NAME (lists separated by commas, a switch as 1, true,
yes or on). A flag given on the command line wins.
"""
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class _Parser(argparse.ArgumentParser):
    """A command's parser that knows the environment variable of each flag, and names it in an error about a
    value that came from there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.environment: dict[str, argparse.Action] = {}  # variable -> the flag's action
        self.from_environment: dict[str, str] = {}  # flag -> its variable, for the values read from there

    def error(self, message: str):
        for flag, variable in self.from_environment.items():
            if message.startswith(f"argument {flag}:"):  # argparse's words: "argument --dtype: invalid choice..."
                message = f"{message} (from the environment: {variable})"
                break
        super().error(message)

    def environment_arguments(self, environ: Mapping[str, str]) -> list[str]:
        """The flags that `environ` sets, as command-line arguments."""
        arguments: list[str] = []
        for variable, action in self.environment.items():
            value = environ.get(variable)
            if value is None:
                continue
            flag = action.option_strings[0]
            if action.nargs == 0:  # a switch
                if value.strip().lower() not in _TRUE + _FALSE:
                    self.error(f"{variable}={value!r} is not a switch's value: 1, true, yes, on, or 0, false, no, off")
                given = [flag] if value.strip().lower() in _TRUE else []
            elif action.nargs == "+":
                given = [flag, *value.split(",")] if value else []  # empty: none, as if unset
            else:
                given = [f"{flag}={value}"]  # one argument, even when the value begins with "-"
            if given:
                self.from_environment[flag] = variable
            arguments += given
        return arguments


def _env_name(flag: str) -> str:
    return "TOKENRELAY_" + flag.lstrip("-").replace("-", "_").upper()


def _option(parser: _Parser, flag: str, *, help: str, env: str = "", **kwargs) -> None:
    """A flag that TOKENRELAY_<FLAG> (or the variable named by `env`) may set instead."""
    env = env or _env_name(flag)
    default = kwargs.get("default")
    shown = f"; default {default}" if default not in (None, "") else ""
    parser.environment[env] = parser.add_argument(flag, help=f"{help} (env {env}{shown})", **kwargs)


def _log_options(parser: _Parser) -> None:
    _option(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    _log_format_option(parser)


def _log_format_option(parser: _Parser) -> None:
    """Every command's, bench's and usage's too (they log warnings only)."""
    _option(
        parser,
        "--log-format",
        choices=["json", "console"],
        default=None,
        help="log lines as JSON objects, or as structlog's console lines for people; default: console where stderr "
        "is a terminal, else json",
    )


def _topic_options(parser: _Parser) -> None:
    _option(parser, "--topic-prefix", default="tokenrelay", help="prefix of every topic name")


def _gateway_options(parser: _Parser) -> None:
    _option(parser, "--host", default="127.0.0.1", help="address to listen on")
    _option(parser, "--port", type=_number(int, 0, 65535), default=1025, help="port to listen on (MindIE's is 1025)")
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
        type=_at_least_one,
        default=40,
        help="largest request body in MB; larger ones get 413 (maxRequestLength)",
    )
    _option(
        parser,
        "--request-timeout",
        type=_at_least_one,
        default=600,
        help="seconds from a request's arrival to its last token, for a request that sets no timeout of its own; "
        "then it ends (e2eTimeout)",
    )
    _option(
        parser,
        "--max-in-flight",
        type=_at_least_one,
        default=4096,
        help="requests this gateway waits for at once; beyond that, 429 with Retry-After",
    )
    _option(
        parser,
        "--max-waiting-requests",
        type=_at_least_zero,
        default=0,
        help="requests of a model waiting for a worker (held here, or sent to a worker and not started), "
        "past which a new one that no worker has room for gets 429 with Retry-After at once; 0: no bound",
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
    _option(
        parser,
        "--reject-unknown-fields",
        action="store_true",
        default=False,
        help="refuse (422) a body's field that no document lists, instead of ignoring it and naming it in the "
        "answer's X-Ignored-Fields header and the log",
    )
    _option(parser, "--api-keys", nargs="+", default=[], help="API keys clients must send (Bearer); none: open")
    _option(parser, "--api-keys-file", default="", help="a file of API keys, one per line (with --api-keys, all count)")
    _option(
        parser,
        "--tenants-file",
        default="",
        help="a TOML or YAML file of tenants: their API keys, fair-share weights, limits per minute and at once, "
        "allowed priorities, models and max_tokens; read again when it changes and on SIGHUP",
    )
    _option(
        parser,
        "--admin-api-keys",
        nargs="+",
        default=[],
        help="keys (Bearer) allowed to load and unload LoRA adapters at run time (/v1/load_lora_adapter); none: "
        "run-time loading is refused",
    )
    _option(
        parser,
        "--lora-root",
        default="",
        help="the directory under which LoRA adapters loaded at run time must lie; empty: run-time loading is refused",
    )
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


def _number(kind: type[int] | type[float], low: float, high: float | None = None) -> Callable[[str], float]:
    """A flag's type: a number of `kind` from `low` (to `high`), refused outside that range, which the refusal
    names. Named as `kind` is, so that argparse calls what is no number an "invalid int value"."""

    def number(text: str) -> float:
        value = kind(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is below {low}" if high is None else f"{value} is not in [{low}, {high}]"
            )
        return value

    number.__name__ = kind.__name__
    return number


_parallel_size = _number(int, 1, 64)
_at_least_zero, _at_least_one = _number(int, 0), _number(int, 1)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _model_options(parser: _Parser) -> None:
    """The model a worker loads: no simulated worker has one."""
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
    _option(parser, "--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    dtypes = ["", *DTYPE_NAMES]
    _option(parser, "--dtype", default="", choices=dtypes, help="model dtype; empty: bf16 on CUDA, fp32 on CPU")
    _option(
        parser,
        "--model-impl",
        default="auto",
        choices=MODEL_IMPLS,
        help="the model code: native (the engine's own, for Llama, Mistral, Qwen2 and Qwen3 from safetensors), "
        "transformers (its modeling classes, any architecture), or auto: native where it can",
    )
    _option(
        parser,
        "--tensor-parallel-size",
        type=_parallel_size,
        default=1,
        help="split a native model across this many devices (GPUs cuda:0..N-1, or ranks sharing the CPU), one "
        "process each: this one is rank 0 and starts the others",
    )
    _option(
        parser,
        "--distributed-init",
        default="",
        help="where the ranks of --tensor-parallel-size meet, tcp://HOST:PORT on this host; empty: a free "
        "loopback port",
    )
    _option(
        parser,
        "--kv-cache-memory",
        type=_number(float, 0),
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
        "--speculative",
        choices=("", "ngram"),
        default="",
        help="propose tokens and verify them within each decode step: ngram (prompt lookup, the tokens that "
        "followed the context's last n-gram earlier); the output is the same, only its pace differs",
    )
    _option(
        parser,
        "--speculative-model",
        default="",
        help=f"propose tokens with this draft model (a directory; the target's tokenizer), verified within each "
        f"decode step; the bundled model's draft: {BUNDLED_DRAFT_MODEL}",
    )
    _option(
        parser,
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="tokens proposed per sequence and step, at most (from 1 to 16)",
    )
    _option(
        parser,
        "--speculative-always",
        action="store_true",
        default=False,
        help="propose in every decode step, without the measured rule that stops proposing where it would lower "
        "the tokens per second (for a proposer known to pay, as vLLM and TGI always propose)",
    )
    _option(parser, "--ngram-min", type=int, default=2, help="the shortest n-gram prompt lookup matches (at least 1)")
    _option(parser, "--ngram-max", type=int, default=4, help="the longest n-gram prompt lookup matches (at most 16)")


def _engine_options(parser: _Parser) -> None:
    """The engine around the model, loaded or simulated, and the worker it serves."""
    _option(
        parser,
        "--lora",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter (PEFT's format) in directory PATH as model NAME (several, or repeated)",
    )
    _option(
        parser,
        "--max-loras",
        type=int,
        default=0,
        help="LoRA adapters in device slots at once (each step computes over them); 0: 4 where --lora names any, "
        "else no adapters are served",
    )
    _option(parser, "--max-cpu-loras", type=int, default=0, help="LoRA adapters kept in host memory; 0: --max-loras")
    _option(parser, "--max-lora-rank", type=int, default=64, help="the highest rank of a LoRA adapter served")
    _option(
        parser,
        "--served-model-name",
        nargs="+",
        default=None,
        help=f"names clients use for the model, aliases of each other; "
        f"default: {BUNDLED_MODEL_NAME} for the bundled model, the profile's name when simulated, else --model",
    )
    _option(
        parser,
        "--max-batch-size",
        type=_at_least_zero,
        default=0,
        help="sequences that run at once (maxBatchSize); 0: 64 on the CPU, 256 on a GPU",
    )
    _option(parser, "--max-seq-len", type=_at_least_one, default=2560, help="prompt + generated tokens (maxSeqLen)")
    _option(parser, "--max-input-len", type=_at_least_one, default=2048, help="prompt tokens (maxInputTokenLen)")
    _option(
        parser, "--max-iter-times", type=_at_least_one, default=512, help="generated tokens per request (maxIterTimes)"
    )
    _option(
        parser,
        "--max-tokens-per-step",
        type=_at_least_zero,
        default=0,
        help="tokens one engine step computes: a token per decoding sequence, the rest on prompt chunks; "
        "0: 1024 on the CPU, 2048 on a GPU",
    )
    _option(parser, "--block-size", type=_at_least_one, default=32, help="tokens per KV cache block")
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
        "--engine-stuck-timeout",
        type=float,
        default=300.0,
        help="seconds an engine step may run before the worker takes its engine for stuck and exits (status 1), "
        "so that an orchestrator restarts it and the gateways fail its requests over; 0: never",
    )


def _fleet_worker_options(parser: _Parser, simulate_default: str) -> None:
    """A worker among others on Kafka: its request topics, its heartbeats, its model simulated or not."""
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
        default=simulate_default,
        help="simulate the model with a step-time profile (a file, or one of "
        f"{', '.join(simulation_profiles())}): no weights, no torch; "
        "empty: run --model (`tokenrelay simulate`: bundled-cpu)",
    )
    _option(
        parser,
        "--metrics-address",
        default="",
        help="HOST:PORT where the worker serves GET /metrics (Prometheus); empty: nowhere",
    )


def _bus_options(parser: _Parser) -> None:
    _option(
        parser,
        "--max-message-bytes",
        type=int,
        default=16 * 2**20,
        help="largest message the bus carries, on Kafka (its producer, the topics created, the fetches) and in "
        "process alike: a request larger on the bus (its images count) is answered 413 before it is published",
    )


def _kafka_options(parser: _Parser) -> None:
    _option(parser, "--kafka-bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    _option(parser, "--kafka-replication-factor", type=int, default=1, help="replication of the topics created here")
    _option(
        parser,
        "--kafka-publish-timeout",
        type=float,
        default=1.5,
        help="seconds a message may take to reach the broker; after that the publisher gives up "
        "(a gateway answers 503)",
    )


def _kafka_group_options(parser: _Parser) -> None:
    """A worker's membership of its consumer group: gateways join none."""
    _option(
        parser,
        "--kafka-session-timeout-ms",
        type=int,
        default=6_000,
        help="how long the group waits for a silent member before its partitions move "
        "(a dead worker's unread requests wait this long)",
    )
    _option(parser, "--kafka-heartbeat-interval-ms", type=int, default=1_000, help="group heartbeat period")
    _option(
        parser,
        "--kafka-max-poll-interval-ms",
        type=int,
        default=60_000,
        help="longest pause between polls before the member is dropped",
    )


def build_parser() -> _Parser:
    parser = _Parser(prog="tokenrelay", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    _log_options(up)
    _topic_options(up)
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
    usage = commands.add_parser(
        "usage",
        help="the usage topic summed per tenant and period: requests, prompt, cached and output tokens",
        description="Read every usage record on the Kafka topic <prefix>.usage (one per request, published by "
        "the gateway that answered it) and sum them per tenant and --period of their end, each request once.",
    )
    _option(usage, "--kafka-bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    _topic_options(usage)
    _option(usage, "--period", default="day", choices=["hour", "day", "month", "all"], help="rows per tenant per")
    _option(usage, "--since", default="", help="requests that ended at or after this ISO 8601 time (UTC if bare)")
    _option(usage, "--until", default="", help="requests that ended before this ISO 8601 time (UTC if bare)")
    _option(usage, "--json", action="store_true", default=False, help="one JSON object instead of a table")
    _log_format_option(usage)
    bench = commands.add_parser(
        "bench",
        help="benchmarks: `tokenrelay bench "
        "{engine,serve,chaos,rolling,scale,priority,tenants,profile,kernels,shard} --help`",
        description="Benchmarks; each has its own options: `tokenrelay bench BENCHMARK --help`.",
    )
    bench.add_argument(
        "benchmark",
        choices=["engine", "serve", "chaos", "rolling", "scale", "priority", "tenants", "profile", "kernels", "shard"],
    )
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    _log_format_option(bench)  # before the benchmark's name: what follows it is the benchmark's
    for sub in (serve, gateway, worker, simulate):
        _log_options(sub)
    for sub in (gateway, worker, simulate):  # serve's topics are its own process's
        _topic_options(sub)
    for sub in (serve, gateway):
        _gateway_options(sub)
    for sub in (serve, worker):
        _model_options(sub)
    for sub in (serve, worker, simulate):
        _engine_options(sub)
    _fleet_worker_options(worker, simulate_default="")
    _fleet_worker_options(simulate, simulate_default="bundled-cpu")
    for sub in (gateway, worker, simulate):
        _kafka_options(sub)
    for sub in (worker, simulate):
        _kafka_group_options(sub)
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
    for sub in (serve, gateway, worker):
        _option(
            sub,
            "--mindie-config",
            default="",
            help="MindIE Service's config.json, each key read as the flag it means (docs/coming-from-mindie.md); "
            "flags given beside it win",
        )
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, _Parser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def command_flags(command: str) -> dict[str, argparse.Action]:
    """The flags of `tokenrelay <command>`, each with its action (its type, its destination)."""
    return {flag: action for action in _commands(build_parser())[command]._actions for flag in action.option_strings}


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """`argv` (default: this process's arguments) with the flags `environ` (default: this process's) sets; the
    arguments parsed, the environment's among them, are kept as `arguments`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = _commands(parser)
    help_asked = "-h" in argv or "--help" in argv  # help, even when a variable holds a wrong value
    if argv and argv[0] in commands and not help_asked:
        argv[1:1] = commands[argv[0]].environment_arguments(os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    args.arguments = argv
    return args


def parse_beneath(args: argparse.Namespace, arguments: Sequence[str]) -> argparse.Namespace:
    """`args` parsed again with `arguments` (a file's flags) before all those that gave it, which win."""
    return parse_args([args.command, *arguments, *args.arguments[1:]], environ={})
