"""docker-compose.yml and its Dockerfile, checked by reading them (no Docker engine runs here).

docker-compose.yml is validated against the Compose specification's JSON schema, vendored as
deploy/compose-spec.json: schema/compose-spec.json of the Go module github.com/compose-spec/compose-go/v2
at v2.17.0 (the schema `docker compose` itself checks files with). Each service's settings are started as far
as they go here (`started`, which the Helm chart's tests use too).
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import jsonschema
import pytest
import yaml
from huggingface_hub.utils import HFValidationError, validate_repo_id

from bus.factory import open_bus
from bus.settings import InProcessSettings
from tests.processes import REPO
from tokenrelay.flags.commands import build_parser
from tokenrelay.http_server import http_server
from tokenrelay.lifecycle import CannotStart
from tokenrelay.settings import Settings, settings_from
from workers.bundled import BUNDLED_MODEL, BUNDLED_VISION_MODEL


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _flags_of(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def started(command: str, environ: Mapping[str, str], mounts: Sequence[str] = ()) -> Settings:
    """`tokenrelay COMMAND` (gateway or worker) in the environment `environ`, started as far as it goes without a
    broker, a GPU or its model's weights; its settings, as the process holds them.

    Its line and environment are parsed as the process parses them, so every value is checked as its flag is
    (SystemExit 2, naming the variable), and its settings are built as the process builds them (CannotStart: a
    lone TLS flag, a simulation profile that is not there, a metrics address without a port). Then what the
    process checks before it serves: a gateway's HTTP server is built (the app, its keys); a worker's model is
    looked for where the worker will look: a directory must lie on one of the volumes the container mounts at
    `mounts`, a hub id must be one; the bundled models are in the image. What only the running process finds
    out is not: a broker that answers, the weights themselves, the GPU and its memory, a free port.
    """
    settings = settings_from([command], environ)
    if settings.server is not None:
        http_server(settings.server, settings.gateway, open_bus(InProcessSettings(), client_id="test"))
    model = settings.model
    if model is None or model.simulate or model.path in (str(BUNDLED_MODEL), str(BUNDLED_VISION_MODEL)):
        pass  # no model to look for, or one in the image
    elif model.path.startswith(("/", ".")):
        on_volume = [m for m in mounts if Path(model.path).is_relative_to(m)]
        assert on_volume, f"--model {model.path} is in no volume of the container ({', '.join(mounts)}) nor the image"
    else:
        validate_repo_id(model.path)  # what the hub client refuses before it asks the hub
    return settings


def test_compose_runs_a_broker_a_gateway_and_workers():
    services = _compose()["services"]
    assert set(services) == {"kafka", "gateway", "worker"}
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["gateway"]["command"] == ["tokenrelay", "gateway"]
    assert services["worker"]["command"] == ["tokenrelay", "worker"]
    assert services["worker"]["deploy"]["replicas"] >= 2
    for name in ("gateway", "worker"):
        assert services[name]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_every_setting_in_compose_is_a_flag_of_its_command_and_starts_it():
    services = _compose()["services"]
    for name in ("gateway", "worker"):
        command = services[name]["command"][1]
        flags = _flags_of(command)
        environment = {variable: str(value) for variable, value in services[name]["environment"].items()}
        for variable in environment:
            assert variable.startswith("TOKENRELAY_"), variable
            flag = "--" + variable.removeprefix("TOKENRELAY_").lower().replace("_", "-")
            assert flag in flags, f"{name}: {variable} names no flag of `tokenrelay {name}`"
        started(command, environment)


def test_starting_refuses_what_the_process_would_refuse(capsys):
    """`started` stops where the process would: a value its flag refuses, a lone TLS flag, a model not there."""
    kafka = {"TOKENRELAY_KAFKA_BOOTSTRAP": "kafka:9092"}
    with pytest.raises(SystemExit) as refused:
        started("worker", {**kafka, "TOKENRELAY_DTYPE": "bf16"})
    assert refused.value.code == 2 and "(from the environment: TOKENRELAY_DTYPE)" in capsys.readouterr().err
    with pytest.raises(CannotStart, match="--tls-cert and --tls-key go together"):
        started("gateway", {**kafka, "TOKENRELAY_TLS_CERT": "/tls/cert.pem"})
    with pytest.raises(CannotStart, match="no simulation profile 'h100'"):
        started("worker", {**kafka, "TOKENRELAY_SIMULATE": "h100"})
    with pytest.raises(AssertionError, match="is in no volume of the container"):
        started("worker", {**kafka, "TOKENRELAY_MODEL": "/models/llama"}, mounts=["/dev/shm"])
    with pytest.raises(HFValidationError):
        started("worker", {**kafka, "TOKENRELAY_MODEL": "meta llama/8b"})
    assert started("worker", {**kafka, "TOKENRELAY_MODEL": "/models/llama"}, mounts=["/models"]).model.path == (
        "/models/llama"
    )


def test_services_reach_the_broker_where_it_advertises_itself():
    services = _compose()["services"]
    advertised = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split("//", 1)[1]
    for name in ("gateway", "worker"):
        assert services[name]["environment"]["TOKENRELAY_KAFKA_BOOTSTRAP"] == advertised


def _dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile's instructions, (INSTRUCTION, its arguments), continued lines joined, comments left out."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    return [(line.split(None, 1)[0], " ".join(line.split()[1:])) for line in lines]


def test_the_image_holds_every_package():
    copied = {args.split()[0].rstrip("/") for instruction, args in _dockerfile() if instruction == "COPY"}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied - {"pyproject.toml"} == packages
    for name in ("gateway", "worker"):
        build = _compose()["services"][name]["build"]
        assert (REPO / build["context"] / build["dockerfile"]).is_file()


def test_the_image_installs_exactly_the_locked_runtime_dependencies_with_the_makefiles_uv():
    instructions = _dockerfile()
    copied = [args.split() for instruction, args in instructions if instruction == "COPY"]
    assert ["pyproject.toml", "uv.lock", "README.md", "LICENSE", "NOTICE", "./"] in copied
    runs = [args for instruction, args in instructions if instruction == "RUN"]
    installs = [run for run in runs if re.search(r"\b(pip|uv)\b", run)]
    pinned = re.fullmatch(r"UV_VERSION=(\S+)", next(args for instruction, args in instructions if instruction == "ARG"))
    makefile = re.search(r"^UV_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert pinned and makefile and pinned.group(1) == makefile.group(1)
    assert installs[0] == "pip install --no-cache-dir uv==${UV_VERSION}"  # uv itself; nothing else through pip
    syncs = installs[1:]
    python = "--python /usr/local/bin/python3"
    assert syncs == [
        f"uv sync --locked --no-dev --no-install-project {python}",  # the dependencies' layer
        f"uv sync --locked --no-dev --no-editable {python}",  # then the project itself, as a wheel would be
    ]
    env = " ".join(args for instruction, args in instructions if instruction == "ENV")
    assert "UV_PYTHON_DOWNLOADS=never" in env and "PATH=/opt/tokenrelay/bin:$PATH" in env


def test_the_image_runs_as_an_unprivileged_user_that_has_a_home():
    instructions = _dockerfile()
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users == ["10001:10001"]  # numeric: a kubelet checks runAsNonRoot against the image's user only so
    assert [instruction for instruction, _ in instructions][-3:] == ["USER", "EXPOSE", "CMD"]  # all built as root
    created = next(args for instruction, args in instructions if instruction == "RUN" and "useradd" in args)
    assert "groupadd --gid 10001 tokenrelay" in created
    assert "useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tokenrelay" in created
    assert ("ENV", "HOME=/home/tokenrelay") in instructions


def _seconds(duration: str) -> float:
    """A Compose duration (`1m30s`, `60s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_follows_the_compose_specification():
    schema = json.loads((REPO / "deploy" / "compose-spec.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, errors
    broken = _compose()
    broken["services"]["worker"]["stop_grace_perod"] = "60s"  # the schema refuses unknown keys
    assert not validator.is_valid(broken)


def test_compose_keeps_in_step_with_the_helm_chart():
    """Same grace periods and drain timeouts as the chart's defaults, the same worker metrics port."""
    services = _compose()["services"]
    values = yaml.safe_load((REPO / "deploy" / "helm" / "tokenrelay" / "values.yaml").read_text())
    for name in ("gateway", "worker"):
        grace = _seconds(services[name]["stop_grace_period"])
        assert grace == values[name]["terminationGracePeriodSeconds"]
        assert float(services[name]["environment"]["TOKENRELAY_DRAIN_TIMEOUT"]) + 10 <= grace
    port = services["worker"]["environment"]["TOKENRELAY_METRICS_ADDRESS"].rpartition(":")[2]
    assert int(port) == values["worker"]["metricsPort"]
    assert services["worker"]["expose"] == [port]
    assert services["gateway"]["environment"]["TOKENRELAY_PORT"] == str(values["gateway"]["port"])


def test_broker_sh_stop_says_what_it_stopped_or_that_nothing_ran(tmp_path):
    stop = [str(REPO / "deploy/kafka/broker.sh"), "stop", "--dir", str(tmp_path)]
    assert subprocess.run(stop, capture_output=True, text=True).stderr == (
        f"no Kafka broker runs from {tmp_path}: nothing to stop\n"
    )
    running = subprocess.Popen(["sleep", "60"])  # stands for a broker: what stop does is kill the pid in the file
    (tmp_path / "broker.pid").write_text(str(running.pid))
    said = subprocess.run(stop, capture_output=True, text=True).stderr
    assert said == f"stopped the Kafka broker of {tmp_path} (pid {running.pid})\n"
    assert running.wait(5) != 0 and not (tmp_path / "broker.pid").exists()
    (tmp_path / "broker.pid").write_text(str(running.pid))  # a pid file left by a broker that died
    said = subprocess.run(stop, capture_output=True, text=True).stderr
    assert said == f"the Kafka broker of {tmp_path} (pid {running.pid}) had already exited\n"
