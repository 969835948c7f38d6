"""The `tokenrelay` commands and the flags each takes: one table, COMMANDS, of the groups of flags per command.

Adding a flag to the worker is adding it to its group (worker.py's model,
engine or fleet flags): every command whose row names the group takes it.
What a flag becomes is tokenrelay/settings.py's; each command takes only the
flags that do something there. Beneath the command line and the environment
(parser.py) lies a MindIE config.json (--mindie-config), whose keys are read
as the flags they mean (tokenrelay/mindie_config.py), so either of those
wins over it.

Only the parser is built here: what each command runs (tokenrelay/launch.py
and the modules it imports: uvicorn, FastAPI, aiokafka, torch) is imported
once the command line is parsed, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tokenrelay.flags.bus import bus_options, kafka_group_options, kafka_options
from tokenrelay.flags.common import drain_option, log_format_option, log_options, mindie_config_option, topic_options
from tokenrelay.flags.gateway import gateway_options
from tokenrelay.flags.parser import Parser, option
from tokenrelay.flags.worker import engine_options, fleet_worker_options, model_options, simulated_fleet_options

_DESCRIPTION = """\
    tokenrelay serve     gateway + worker + in-process bus, one process, no broker
    tokenrelay gateway   an HTTP/WebSocket gateway on Kafka
    tokenrelay worker    a model worker on Kafka
    tokenrelay simulate  many simulated workers in one process, on Kafka
    tokenrelay up        gateways and workers on one Kafka, on this machine
    tokenrelay usage     the usage topic summed per tenant and period
    tokenrelay bench     benchmarks (engine, host, serve, chaos, rolling, scale, priority, tenants, profile, kernels,
                         shard)

Every flag can also come from the environment: `--served-model-name` is
TOKENRELAY_SERVED_MODEL_NAME (lists separated by commas, a switch as 1, true,
yes or on). A flag given on the command line wins.
"""
BENCHMARKS = ["engine", "host", "serve", "chaos", "rolling", "scale", "priority", "tenants", "profile", "kernels"]
BENCHMARKS += ["shard"]


def up_options(parser: Parser) -> None:
    option(parser, "--gateways", type=int, default=1, help="gateway processes")
    option(parser, "--workers", type=int, default=2, help="worker processes")
    option(parser, "--host", default="127.0.0.1", help="address the gateways listen on")
    option(parser, "--port", type=int, default=1025, help="the first gateway's port; the others follow it")
    option(parser, "--kafka-bootstrap", default="", help="Kafka bootstrap servers; empty: start a local broker")
    option(
        parser,
        "--kafka-brokers",
        type=int,
        default=1,
        help="brokers of the local Kafka: 1, or 3 or more for a replicated cluster that loses nothing when a "
        "broker dies (topics replicated min(N, 3) times, min.insync.replicas 2; with --kafka-bootstrap: "
        "that cluster's brokers)",
    )
    option(parser, "--worker-args", default="", help="more flags for every worker, as one string")
    option(parser, "--gateway-args", default="", help="more flags for every gateway, as one string")
    option(parser, "--log-dir", default="", help="where each process logs; empty: a temporary directory")


def usage_options(parser: Parser) -> None:
    option(parser, "--kafka-bootstrap", required=True, help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]")
    topic_options(parser)
    option(parser, "--period", default="day", choices=["hour", "day", "month", "all"], help="rows per tenant per")
    option(parser, "--since", default="", help="requests that ended at or after this ISO 8601 time (UTC if bare)")
    option(parser, "--until", default="", help="requests that ended before this ISO 8601 time (UTC if bare)")
    option(parser, "--json", action="store_true", default=False, help="one JSON object instead of a table")


def bench_arguments(parser: Parser) -> None:
    """The benchmark and its own options: the flags given before its name are `bench`'s (--log-format)."""
    parser.add_argument("benchmark", choices=BENCHMARKS)
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")


Group = Callable[[Parser], None]


@dataclass(frozen=True)
class Command:
    help: str
    groups: tuple[Group, ...]  # its flags, group by group, in its --help's order
    description: str | None = None


COMMANDS = {
    "serve": Command(
        "gateway and worker in one process, in-process bus",
        (log_options, gateway_options, model_options, engine_options, bus_options, drain_option, mindie_config_option),
    ),
    "gateway": Command(
        "an HTTP/WebSocket gateway on Kafka",
        (log_options, topic_options, gateway_options, kafka_options, bus_options, drain_option, mindie_config_option),
    ),
    "worker": Command(
        "a model worker on Kafka",
        (
            log_options,
            topic_options,
            model_options,
            engine_options,
            fleet_worker_options,
            kafka_options,
            kafka_group_options,
            bus_options,
            drain_option,
            mindie_config_option,
        ),
    ),
    "simulate": Command(
        "many simulated workers in one process, on Kafka",
        (
            log_options,
            topic_options,
            engine_options,
            simulated_fleet_options,
            kafka_options,
            kafka_group_options,
            bus_options,
            drain_option,
        ),
        "Run --workers workers in one process, each the real worker and engine around a simulated model "
        "(--simulate, default bundled-cpu): steps take the profile's time and tokens come from each request's "
        "seed. A fleet on one machine, for `tokenrelay bench scale`.",
    ),
    "up": Command(
        "gateways and workers on one Kafka, on this machine, to try out",
        (log_options, topic_options, up_options),
        "Start --workers workers and --gateways gateways on one Kafka (a local broker from deploy/kafka/ unless "
        "--kafka-bootstrap is given), the gateways on consecutive ports from --port (1025, 1026, ...: no load "
        "balancer in front; point clients at any of them). Stops them all on SIGINT/SIGTERM, or when one of them "
        "dies.",
    ),
    "usage": Command(
        "the usage topic summed per tenant and period: requests, prompt, cached and output tokens",
        (usage_options, log_format_option),
        "Read every usage record on the Kafka topic <prefix>.usage (one per request, published by the gateway "
        "that answered it) and sum them per tenant and --period of their end, each request once.",
    ),
    "bench": Command(
        f"benchmarks: `tokenrelay bench {{{','.join(BENCHMARKS)}}} --help`",
        (bench_arguments, log_format_option),
        "Benchmarks; each has its own options: `tokenrelay bench BENCHMARK --help`.",
    ),
}


def build_parser() -> Parser:
    parser = Parser(prog="tokenrelay", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.description)
        for group in command.groups:
            group(sub)
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, Parser]:
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
