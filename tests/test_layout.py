"""The import contracts catch what they are for: `make test` runs lint-imports on the tree (pyproject.toml's
[tool.importlinter]), and here a copy of the tree with one bad import planted must fail it, naming the import.

From the bottom: schemas/ (the typed messages), bus/, telemetry/ (logs and
metrics), then gateway/ and workers/ side by side (neither imports the other),
and tokenrelay/ (the command, its settings, the benches) on top. The engine
(workers/engine/) runs without the bus: the worker translates between them;
nothing that serves imports the bundled models' training. No circle, at any
depth: every import counts, a function's deferred import and one under
`if TYPE_CHECKING:` too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO

PACKAGES = ("schemas", "bus", "telemetry", "gateway", "workers", "tokenrelay")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_of_the_tree(root: Path) -> Path:
    """The packages' modules (not their checkpoints) and pyproject.toml, under `root`."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=lambda _, names: [n for n in names if _not_code(n)])
    shutil.copy(REPO / "pyproject.toml", root)
    return root


def _not_code(name: str) -> bool:
    return name == "__pycache__" or ("." in name and not name.endswith(".py"))


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the tree under `root`: its packages, not the installed ones, come first on the path."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = [str(LINT_IMPORTS), "--no-cache", "--no-logo"]
    return subprocess.run(run, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_as_it_is_keeps_every_contract(tmp_path):
    checked = _lint_imports(_copy_of_the_tree(tmp_path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Contracts: 6 kept, 0 broken." in checked.stdout


@pytest.mark.parametrize(
    "module, planted, named",
    [
        # an upward import, deferred into a function
        ("schemas/placement.py", "def _f():\n    import gateway.errors\n", "schemas.placement -> gateway.errors (l."),
        # the gateway and the workers are independent
        ("gateway/errors.py", "from workers.bundled import BUNDLED_MODEL\n", "gateway.errors -> workers.bundled (l."),
        # the engine below the worker
        ("workers/engine/config.py", "import workers.worker\n", "workers.engine.config -> workers.worker (l."),
        # the engine without the bus
        ("workers/engine/config.py", "import bus.topics\n", "workers.engine.config -> bus.topics (l."),
        # nothing serving imports the training scripts
        ("tokenrelay/cli.py", "import workers.bundled.training.model\n", "tokenrelay.cli -> workers.bundled.training"),
        # the gateway's own layers: tenancy below the service
        ("gateway/tenancy/usage.py", "import gateway.service\n", "gateway.tenancy.usage -> gateway.service (l."),
        # a circle between two modules of the engine, hidden from the interpreter by TYPE_CHECKING
        (
            "workers/engine/request.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.engine.engine import Engine\n",
            "- .request -> .engine",
        ),
        # a circle between two packages of the gateway (tenancy's usage records are made of dispatch's requests)
        ("gateway/dispatch/inflight.py", "import gateway.tenancy.usage\n", "No cycles are allowed in gateway."),
    ],
)
def test_a_planted_import_breaks_its_contract_and_is_named(tmp_path, module, planted, named):
    root = _copy_of_the_tree(tmp_path)
    with open(root / module, "a", encoding="utf-8") as source:
        source.write("\n\n" + planted)
    checked = _lint_imports(root)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert named in checked.stdout, checked.stdout
