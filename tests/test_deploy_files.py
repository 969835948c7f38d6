"""docker-compose.yml and its Dockerfile, checked by reading them (no Docker engine runs here)."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.processes import REPO
from tokenrelay.cli import build_parser


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _flags_of(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def test_compose_runs_a_broker_a_gateway_and_workers():
    services = _compose()["services"]
    assert set(services) == {"kafka", "gateway", "worker"}
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["gateway"]["command"] == ["tokenrelay", "gateway"]
    assert services["worker"]["command"] == ["tokenrelay", "worker"]
    assert services["worker"]["deploy"]["replicas"] >= 2
    for name in ("gateway", "worker"):
        assert services[name]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_every_setting_in_compose_is_a_flag_of_its_command():
    services = _compose()["services"]
    for name in ("gateway", "worker"):
        flags = _flags_of(services[name]["command"][1])
        for variable in services[name]["environment"]:
            assert variable.startswith("TOKENRELAY_"), variable
            flag = "--" + variable.removeprefix("TOKENRELAY_").lower().replace("_", "-")
            assert flag in flags, f"{name}: {variable} names no flag of `tokenrelay {name}`"


def test_services_reach_the_broker_where_it_advertises_itself():
    services = _compose()["services"]
    advertised = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split("//", 1)[1]
    for name in ("gateway", "worker"):
        assert services[name]["environment"]["TOKENRELAY_KAFKA_BOOTSTRAP"] == advertised


def test_the_image_holds_every_package():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+)/ ", dockerfile, re.MULTILINE))
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied == packages
    for name in ("gateway", "worker"):
        build = _compose()["services"][name]["build"]
        assert (REPO / build["context"] / build["dockerfile"]).is_file()
