"""What the device has to import: the image's packages and the carried wheels, by distribution name.

Shared by the dry run's simulated device (sitecustomize.py, here) and the
check of the versions (.ci/device-imports).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

CI = Path(__file__).resolve().parent.parent
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(listing: str) -> dict[str, str | None]:
    """A list file of .ci/: distribution name -> its version there (None where not known)."""
    entries: dict[str, str | None] = {}
    for line in (CI / listing).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            entries[canonical(name)] = version or None
    return entries


def requirements_of(distribution: str) -> list:
    """A distribution's own requirements on the device's Python, as installed here (no extras)."""
    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in metadata.requires(distribution) or []]
    return [r for r in wanted if r.marker is None or r.marker.evaluate(DEVICE_MARKERS)]


def available() -> set[str]:
    """The image's distributions and what they need (installed here: the image is whole, at its own versions),
    the carried ones, and the project itself."""
    found = set(listed("device-image.txt")) | set(listed("device-wheels.txt")) | {"tokenrelay"}
    pending = [name for name in listed("device-image.txt")]
    while pending:
        try:
            needs = requirements_of(pending.pop())
        except metadata.PackageNotFoundError:
            continue
        for requirement in needs:
            name = canonical(requirement.name)
            if name not in found:
                found.add(name)
                pending.append(name)
    return found


class DevicePackages(importlib.abc.MetaPathFinder):
    """Refuses a top-level module whose distributions are all off the device, as the device would."""

    def __init__(self) -> None:
        self.available = available()
        self.owners = metadata.packages_distributions()

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:
            return None  # a submodule: its top-level package was found or refused already
        owners = {canonical(d) for d in self.owners.get(name, [])}
        if owners and not owners & self.available:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the device: {', '.join(owners)})", name=name)
        return None


def install() -> None:
    sys.meta_path.insert(0, DevicePackages())
