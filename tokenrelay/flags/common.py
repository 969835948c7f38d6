"""The flags every process's command shares: its logs, its topics, its drain, a MindIE config beneath."""

from __future__ import annotations

from tokenrelay.flags.parser import Parser, option


def log_options(parser: Parser) -> None:
    option(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    log_format_option(parser)


def log_format_option(parser: Parser) -> None:
    """Every command's, bench's and usage's too (they log warnings only)."""
    option(
        parser,
        "--log-format",
        choices=["json", "console"],
        default=None,
        help="log lines as JSON objects, or as structlog's console lines for people; default: console where stderr "
        "is a terminal, else json",
    )


def topic_options(parser: Parser) -> None:
    option(parser, "--topic-prefix", default="tokenrelay", help="prefix of every topic name")


def drain_option(parser: Parser) -> None:
    option(
        parser,
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds a SIGTERM/SIGINT leaves running requests to end (new ones are refused, or go to other "
        "workers) before the process hands them over and exits; a second signal stops at once",
    )


def mindie_config_option(parser: Parser) -> None:
    option(
        parser,
        "--mindie-config",
        default="",
        help="MindIE Service's config.json, each key read as the flag it means (docs/coming-from-mindie.md); "
        "flags given beside it win",
    )
