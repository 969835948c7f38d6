"""Every benchmark's `--help` answers without importing torch, transformers, the Kafka client or matplotlib, and
says the default of every option that has one.

Those take seconds to import (torch alone 3 to 10 s on a small machine); a benchmark imports them once its
arguments are parsed. Checked by the modules a fresh interpreter holds after each `--help`, not by a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

BENCHMARKS = ("engine", "serve", "chaos", "rolling", "scale", "priority", "tenants", "profile", "kernels", "shard")
HEAVY = ("torch", "transformers", "aiokafka", "matplotlib", "triton")

# For each benchmark in turn, in one interpreter: its --help's exit status and first line, the heavy modules
# imported so far (the first benchmark to import one is the one whose list is not empty), and each option with a
# default (neither None, off nor empty) whose help, as --help shows it, does not say "default:".
SCRIPT = """
import argparse, contextlib, importlib, io, json, sys
parsers = []
parse_args = argparse.ArgumentParser.parse_args
def parse_recorded(parser, *args, **kwargs):
    parsers.append(parser)
    return parse_args(parser, *args, **kwargs)
argparse.ArgumentParser.parse_args = parse_recorded
seen = {}
for name in sys.argv[1].split(","):
    module = importlib.import_module(f"tokenrelay.bench.{name}")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            module.main(["--help"])
            status = None
        except SystemExit as exit:
            status = exit.code
    heavy = sorted(m for m in sys.argv[2].split(",") if m in sys.modules)
    parser = parsers.pop()
    unsaid = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.default is not None and action.default is not False
        and action.default not in ("", [], (), argparse.SUPPRESS)
        and "default:" not in (parser._get_formatter()._expand_help(action) if action.help else "")
    ]
    seen[name] = {"status": status, "usage": shown.getvalue().split("\\n")[0], "heavy": heavy, "unsaid": unsaid}
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    """Each benchmark's --help, as SCRIPT sees it."""
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(BENCHMARKS), ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_benchmarks_help_imports_nothing_heavy(helps):
    seen = helps
    for name in BENCHMARKS:
        assert seen[name]["status"] == 0, (name, seen[name])
        assert seen[name]["usage"].startswith(f"usage: tokenrelay bench {name}"), (name, seen[name])
        assert seen[name]["heavy"] == [], f"`bench {name} --help` imported {seen[name]['heavy']}"


def test_every_benchmarks_help_says_each_options_default(helps):
    unsaid = {name: seen["unsaid"] for name, seen in helps.items() if seen["unsaid"]}
    assert unsaid == {}, f"options whose --help does not say their default: {unsaid}"


COMMANDS = ([], ["serve"], ["gateway"], ["worker"], ["simulate"], ["up"], ["bench"])
# What a command imports once its line is parsed, never for --help: the web stack and the Kafka client too.
RUNTIME = (*HEAVY, "fastapi", "uvicorn", "structlog")

HELP_OF = """
import contextlib, io, json, sys
from tokenrelay.cli import main
with contextlib.redirect_stdout(io.StringIO()) as shown:
    try:
        main(sys.argv[2:] + ["--help"])
    except SystemExit as exit:
        status = exit.code
print(json.dumps({"status": status, "usage": shown.getvalue().split("\\n")[0],
                  "heavy": sorted(m for m in sys.argv[1].split(",") if m in sys.modules)}))
"""


def test_every_commands_help_imports_only_the_parser(capsys):
    slowest = 0.0
    for command in COMMANDS:
        began = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-c", HELP_OF, ",".join(RUNTIME), *command], capture_output=True, text=True, timeout=60
        )
        slowest = max(slowest, time.monotonic() - began)
        assert run.returncode == 0, run.stderr[-3000:]
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        assert seen["status"] == 0, (command, seen)
        assert seen["usage"].startswith(" ".join(["usage: tokenrelay", *command])), (command, seen)
        assert seen["heavy"] == [], f"`tokenrelay {' '.join(command)} --help` imported {seen['heavy']}"
    with capsys.disabled():  # the figure, for the record; a clock is no test on a shared machine
        sys.stderr.write(f"\nslowest `tokenrelay ... --help`, interpreter start included: {slowest:.2f} s\n")
