"""Every benchmark's `--help` answers without importing torch, transformers, the Kafka client or matplotlib.

Those take seconds to import (torch alone 3 to 10 s on a small machine); a benchmark imports them once its
arguments are parsed. Checked by the modules a fresh interpreter holds after each `--help`, not by a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

BENCHMARKS = ("engine", "serve", "chaos", "rolling", "scale", "priority", "tenants", "profile", "kernels", "shard")
HEAVY = ("torch", "transformers", "aiokafka", "matplotlib", "triton")

# For each benchmark in turn, in one interpreter: its --help's exit status and first line, and the heavy
# modules imported so far (the first benchmark to import one is the one whose list is not empty).
SCRIPT = """
import contextlib, importlib, io, json, sys
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
    seen[name] = {"status": status, "usage": shown.getvalue().split("\\n")[0], "heavy": heavy}
print(json.dumps(seen))
"""


def test_every_benchmarks_help_imports_nothing_heavy():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(BENCHMARKS), ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for name in BENCHMARKS:
        assert seen[name]["status"] == 0, (name, seen[name])
        assert seen[name]["usage"].startswith(f"usage: tokenrelay bench {name}"), (name, seen[name])
        assert seen[name]["heavy"] == [], f"`bench {name} --help` imported {seen[name]['heavy']}"


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
