""".ci/gpu-check's CPU dry run: every stage, small, with only the device's packages importable.

A device is lent rarely and for 15 minutes, and each failure there costs a
run: the first H200 run collected no test for want of llguidance. The dry run
runs each stage as the device would (GPU_CHECK_DEVICE=cpu: the bundled model,
a few requests, one test of the device's selection) with the device image's
packages and the carried wheels alone importable (.ci/device_site), and
.ci/device-imports checks the versions of what its processes imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tokenrelay.topology import REPO

DRY_RUN_TESTS = "test_add_rms_norm_equals_torchs"


def test_the_dry_run_passes_every_stage_with_the_devices_packages_and_their_versions_meet_its_imports(tmp_path):
    env = {
        **os.environ,
        "GPU_CHECK_OUT": str(tmp_path),
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_PYTEST_K": DRY_RUN_TESTS,
        "PYTHONPROFILEIMPORTTIME": "1",  # every process lists its imports in its log
    }
    run = subprocess.run(
        [sys.executable, str(REPO / ".ci/gpu-check")], env=env, capture_output=True, text=True, timeout=400
    )
    summary = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert list(summary) == ["install", "versions", "smoke", "imports", "serve", "tests", "bench"]
    failed = {stage: result for stage, result in summary.items() if result["status"] != "pass"}
    assert run.returncode == 0 and not failed, f"{failed}\n{run.stdout}\n{(tmp_path / 'summary.txt').read_text()}"
    assert "as the README" in summary["serve"]["note"]
    assert summary["tests"]["note"] == "30 passed, 0 failed, 0 skipped"
    assert "output tok/s" in summary["bench"]["note"]
    logs = sorted(str(p) for p in tmp_path.glob("*.log"))
    checked = subprocess.run([sys.executable, str(REPO / ".ci/device-imports"), *logs], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "carried:" in checked.stdout and "llguidance==" in checked.stdout


def test_the_simulated_device_refuses_a_package_it_lacks_and_lets_its_own_import():
    code = "import torch, transformers, llguidance\ntry:\n import schemathesis\nexcept ImportError as e:\n print(e)"
    env = {**os.environ, "PYTHONPATH": f"{REPO / '.ci/device_site'}:{REPO}"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "No module named 'schemathesis' (not on the device: schemathesis)"


# A test that starts `tokenrelay` through tests/processes.py needs its console script, which a tree on
# PYTHONPATH (the device's) has not.
_NEEDS_THE_CONSOLE_SCRIPT = {"TOKENRELAY", "spawn_tokenrelay", "serving"}
_SELECTED = r"""
import sys, types, pytest
sys.path.insert(0, ".ci")
found = []
def names(code):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from names(const)
class Look:
    def pytest_collection_finish(self, session):
        for item in session.items:
            functions = [item.function] + [d.func for n in item._fixtureinfo.names_closure
                                            for d in item._fixtureinfo.name2fixturedefs.get(n, ())]
            used = {name for f in functions for name in names(f.__code__)}
            found.append((item.nodeid, sorted(used & set(sys.argv[1].split()))))
args = [line for line in open(".ci/gpu-tests.txt").read().splitlines() if line.strip() and not line.startswith("#")]
import shlex
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *[a for line in args for a in shlex.split(line)]],
            plugins=[Look()])
print("SELECTED", len(found), [f for f in found if f[1]])
"""


def test_no_test_selected_for_the_device_starts_the_console_script_it_lacks():
    run = subprocess.run(
        [sys.executable, "-c", _SELECTED, " ".join(_NEEDS_THE_CONSOLE_SCRIPT)],
        cwd=REPO,
        env={**os.environ, "TOKENRELAY_TEST_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    [line] = [line for line in run.stdout.splitlines() if line.startswith("SELECTED")]
    count, offenders = line.split(" ", 2)[1:]
    assert int(count) > 150 and offenders == "[]", line
