"""Schemathesis over the served OpenAPI document: thousands of generated requests, no 5xx, and every
response (status, content type, body, each event of a stream) as the document describes it, with a
vision-language model behind it, so that the multimodal fields (MindIE's lists, OpenAI's image_url parts,
TGI's markdown images) are fuzzed up to the image checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.processes import serving

SCHEMATHESIS = str(Path(sys.executable).parent / "st")
CONFIG = str(Path(__file__).parent / "schemathesis.toml")


@pytest.mark.timeout(900)
def test_generated_requests_get_no_server_error_and_only_documented_responses(tmp_path):
    # Two tokens per request at most, so that valid requests are quick too. The vision model, under the name
    # schemathesis.toml puts in paths: the image-bearing fields reach a model that takes images.
    vision = ("--vision", "--served-model-name", "tokenrelay-tiny")
    with serving(tmp_path, *vision, "--max-iter-times", "2", "--max-request-length", "8") as served:
        report = tmp_path / "schemathesis.json"
        run = subprocess.run(
            [
                SCHEMATHESIS,
                "--config-file",
                CONFIG,
                "run",
                served.url("/openapi.json"),
                "--checks",
                "not_a_server_error,response_schema_conformance,content_type_conformance,status_code_conformance",
                "--max-examples",
                "50",
                "--seed",
                "20261130",
                "--generation-database",
                "none",
                "--no-color",
                "--report",
                "json",
                "--report-json-path",
                str(report),
            ],
            capture_output=True,
            text=True,
            timeout=800,
            cwd=tmp_path,
        )
        summary = json.loads(report.read_text())
        assert summary["failures"] == [] and summary["errors"] == [], run.stdout[-6000:]
        assert summary["operations"]["tested"] == summary["operations"]["total"] >= 12
        assert summary["test_cases"]["generated"] >= 2000
        assert run.returncode == 0, run.stdout[-6000:]
        assert not served.process.events_named("step_failed")
        # And it still serves an ordinary request.
        answer = httpx.post(served.url("/v2/models/tokenrelay-tiny/generate"), json={"text_input": "Hello"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["text_output"] is not None
