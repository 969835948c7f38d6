"""`make run` on a clean copy of the repository serves the spec's generate example."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import httpx
import pytest

from tests.processes import REPO, Process, free_port, wait_ready
from tests.spec_examples import GENERATE


def _clean_copy(destination) -> None:
    """What a fresh clone holds: the tracked files, plus new ones git does not ignore."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


@pytest.mark.timeout(900)
def test_make_run_serves_the_spec_example(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _clean_copy(checkout)
    port = free_port()
    log_path = tmp_path / "make-run.log"
    make = subprocess.Popen(
        ["make", "run"],
        cwd=checkout,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "TOKENRELAY_PORT": str(port), "TOKENRELAY_SERVED_MODEL_NAME": "llama_65b"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, "llama_65b", [Process(make, log_path)], timeout_s=600)  # a fresh venv is installed first
        response = httpx.post(f"{url}/v2/models/llama_65b/generate", json=GENERATE, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "a123" and response.json()["details"]["generated_tokens"] >= 1
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(60)
