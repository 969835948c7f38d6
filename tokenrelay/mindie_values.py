"""How a value of MindIE's config.json becomes a flag's arguments: checked, and said as the flag says it.

Each converter takes a key's value and the whole file (some keys are read
with others: tlsCaFile with tlsCaPath, npuDeviceIds with worldSize) and gives
the arguments of its key's first flag in tokenrelay/mindie_keys.py, or None
where there is nothing to set (a switch that is false, a key another one
reads). It raises ValueError for a value that cannot be served, said in the
file's terms, and Ignored for a value that makes its key moot here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = "BackendConfig.ModelDeployConfig.ModelConfig"  # a list: one entry per model
SECTIONS = (
    "ServerConfig",
    "BackendConfig",
    "BackendConfig.ModelDeployConfig",
    "BackendConfig.ScheduleConfig",
    "LogConfig",
)


class Ignored(Exception):
    """A key whose value makes it moot here (a TLS file where https is off): why."""


@dataclass(frozen=True)
class MindieFile:
    """A config.json's content, and MindIE's install directory, which its relative paths start from: the one
    above the file's (MindIE keeps it in <install>/conf/)."""

    content: dict
    install_dir: Path

    def value(self, path: str, default: Any = None) -> Any:
        """The value at a key's path ("ServerConfig.port", "...ModelConfig[0].worldSize"), or `default`."""
        node: Any = self.content
        for name, index in re.findall(r"([^.\[\]]+)(?:\[(\d+)\])?", path):
            node = node.get(name) if isinstance(node, dict) else None
            if index:
                node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
        return default if node is None else node

    def path(self, given: str) -> str:
        return str(self.install_dir / given)


Convert = Callable[[Any, MindieFile], list[str] | None]


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def as_integer(value: Any, _: MindieFile) -> list[str]:
    return [str(_integer(value))]


def as_text(value: Any, _: MindieFile) -> list[str]:
    return [_text(value)]


def as_switch(value: Any, _: MindieFile) -> list[str] | None:
    return [] if truth(value) else None


def read_only(check: Callable[[Any], Any]) -> Convert:
    """A key read with others (their converters look at it): its value checked, nothing set."""

    def read(value: Any, _: MindieFile) -> None:
        check(value)

    return read


def host(value: Any, file: MindieFile) -> list[str]:
    if _text(value) in ("0.0.0.0", "::") and file.value("ServerConfig.allowAllZeroIpListening") is not True:
        raise ValueError(f"{value} (every address) needs ServerConfig.allowAllZeroIpListening true, as in MindIE")
    return [value]


def links(value: Any, _: MindieFile) -> list[str]:
    if _integer(value) < 1:
        raise ValueError(f"{value} is below 1")
    return [str(3 * value)]


def _https(file: MindieFile) -> None:
    if file.value("ServerConfig.httpsEnabled") is not True:
        raise Ignored("ServerConfig.httpsEnabled is not true: http")


def tls_file(value: Any, file: MindieFile) -> list[str]:
    _https(file)
    return [file.path(_text(value))]


def tls_directory(value: Any, file: MindieFile) -> None:
    _https(file)
    _text(value)


def tls_ca(value: Any, file: MindieFile) -> list[str]:
    _https(file)
    if not (isinstance(value, list) and len(value) == 1):
        raise ValueError(f"{value!r}: --tls-ca takes one CA bundle: name one file (concatenate several into it)")
    return [file.path(str(Path(file.value("ServerConfig.tlsCaPath", "")) / _text(value[0])))]


def one_instance(value: Any) -> None:
    if _integer(value) != 1:
        raise ValueError(f"{value} instances: a worker is one; start one worker per instance, each with its devices")


def one_node(value: Any) -> None:
    if truth(value):
        raise ValueError("true: a model split across hosts is not served (a worker's ranks share its host)")


def devices(value: Any, file: MindieFile) -> list[str]:
    """One instance's devices, consecutive as a worker's ranks take them: auto where they start at 0 (cuda:0 on
    a GPU host, the CPU on one without), else cuda:N."""
    if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) and value[0]):
        raise ValueError(f"{value!r}: one list, of the devices of this process's one instance")
    ids = [_integer(device) for device in value[0]]
    if ids[0] < 0 or ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"{ids}: a worker's ranks take consecutive devices from one (CUDA_VISIBLE_DEVICES picks)")
    world = file.value(f"{MODELS}[0].worldSize")
    if world is not None and world != len(ids):
        raise ValueError(f"{len(ids)} devices for {MODELS}[0].worldSize {world}: one device per rank")
    return ["auto" if ids[0] == 0 else f"cuda:{ids[0]}"]


def kv_cache(value: Any, _: MindieFile) -> list[str]:
    if _integer(value) < -1:
        raise ValueError(f"{value}: -1 (as the memory allows) or GB per device, at least 0")
    return [str(max(value, 0))]
