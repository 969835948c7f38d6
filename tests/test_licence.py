"""The licence a company adopting tokenrelay reads: LICENSE and pyproject.toml agree, and NOTICE carries what the
licences of the dependencies that the container image redistributes ask for."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import tomllib

from packaging.markers import Marker

from tests.processes import REPO

# The SHA-256 of each licence's canonical text: Apache-2.0's is apache.org's LICENSE-2.0.txt, byte for byte.
CANONICAL = {"Apache-2.0": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"}


def test_license_is_the_canonical_text_of_the_licence_pyproject_declares():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert declared in CANONICAL, f"pyproject.toml's license {declared!r} is not a licence checked here"
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == CANONICAL[declared]


def runtime_dependencies() -> set[str]:
    """The packages `uv sync --no-dev` (no extras) installs from uv.lock on this platform: the image's."""
    packages: dict[str, list[dict]] = {}
    for package in tomllib.loads((REPO / "uv.lock").read_text())["package"]:
        packages.setdefault(package["name"], []).append(package)  # a name locked at two versions is two entries
    wanted, seen = [("tokenrelay", ())], set()
    while wanted:
        name, extras = wanted.pop()
        for package in packages[name]:
            optional = package.get("optional-dependencies", {})
            for group in (package.get("dependencies", []), *(optional.get(extra, []) for extra in extras)):
                for dependency in group:
                    marker = dependency.get("marker")
                    if marker and not Marker(marker).evaluate({"extra": ""}):
                        continue
                    key = (dependency["name"], tuple(dependency.get("extra", ())))
                    if key not in seen:
                        seen.add(key)
                        wanted.append(key)
    return {name for name, _ in seen}


def test_notice_lists_every_redistributed_dependency_and_carries_their_notices():
    notice = (REPO / "NOTICE").read_text()
    listed = set(re.findall(r"^  ([a-z0-9][a-z0-9._-]*) {2,}\S", notice, re.MULTILINE))
    dependencies = runtime_dependencies()
    assert {"torch", "structlog", "uvicorn", "certifi"} <= dependencies  # the walk through the lock reaches them
    assert dependencies - listed == set(), "locked runtime dependencies that NOTICE does not list"
    assert listed - dependencies == set(), "NOTICE lists packages the image does not hold"
    for name in dependencies:  # Apache-2.0, section 4(d): a NOTICE file travels with derivative works
        files = importlib.metadata.distribution(name).files or []
        for file in (f for f in files if f.name == "NOTICE" and "dist-info" in str(f)):
            text = file.read_text().strip()
            carried = "\n".join(("  " + line).rstrip() for line in text.splitlines())
            assert carried in notice, f"NOTICE does not carry {name}'s NOTICE"
