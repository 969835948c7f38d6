"""--mindie-config: a MindIE Service config.json, used as it is, read as the flags its keys mean.

A team that moves from MindIE keeps its deployment's file. Each key in it is
looked up in tokenrelay/mindie_keys.py, and is then one of: set (its flag's
arguments, checked as that flag checks its own, so that a value out of range
is the flag's refusal with the key's JSON path in front), read with another
key, ignored (logged once, with the reason), or unknown (logged once). The
arguments it sets are parsed before the command line's and the environment's,
so a flag given beside the file wins; what the file set, and where a flag
won, is logged in one line.

A file that cannot be read, is not JSON, or holds a value that cannot be
served stops the command in one line (CannotStart), before anything loads.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tokenrelay.flags.commands import command_flags, parse_beneath
from tokenrelay.lifecycle import CannotStart
from tokenrelay.mindie_keys import key_of
from tokenrelay.mindie_values import MODELS, SECTIONS, Ignored, MindieFile

log = structlog.get_logger("tokenrelay")


@dataclass
class Reading:
    """What a file means to one command."""

    arguments: list[str] = field(default_factory=list)  # flags and their values, in the file's order
    settings: dict[str, tuple[str, str, Any]] = field(default_factory=dict)  # key -> flag, as given, as parsed
    ignored: dict[str, str] = field(default_factory=dict)  # key -> why
    unknown: list[str] = field(default_factory=list)


def with_mindie_config(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the keys of its --mindie-config file beneath its flags; what the file set and ignored, logged."""
    reading = read_for(read(args.mindie_config), args.command)
    for path, reason in reading.ignored.items():
        log.info("mindie_config_key_ignored", key=path, reason=reason)
    for path in reading.unknown:
        log.warning("mindie_config_key_unknown", key=path, reason="no key of MindIE's config.json: nothing reads it")
    final = parse_beneath(args, reading.arguments)
    flags = command_flags(args.command)
    log.info(
        "mindie_config_read",
        file=args.mindie_config,
        settings={path: argument for path, (_, argument, _) in reading.settings.items()},
        flags_given_win=[
            path for path, (flag, _, value) in reading.settings.items() if getattr(final, flags[flag].dest) != value
        ],
    )
    return final


def read(path: str) -> MindieFile:
    """The file at `path`: a JSON object, its relative paths taken from the directory above its own."""
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise CannotStart(f"--mindie-config {path}: {error.strerror or error}") from None
    except ValueError as error:  # not UTF-8, or not JSON
        raise CannotStart(f"--mindie-config {path}: not JSON: {error}") from None
    if not isinstance(content, dict):
        raise CannotStart(f"--mindie-config {path}: not a JSON object of MindIE's sections (ServerConfig, ...)")
    return MindieFile(content, Path(path).resolve().parent.parent)


def read_for(file: MindieFile, command: str) -> Reading:
    """What `file` means to `tokenrelay <command>`; CannotStart, naming the key, for a value it cannot serve."""
    flags = command_flags(command)
    models = file.value(MODELS)
    if "--model" in flags and isinstance(models, list) and len(models) > 1:
        raise CannotStart(
            f"{MODELS}: {len(models)} models; a worker serves one: give each model a worker, each with a "
            "config.json of its own model (the gateways serve every model the workers announce)"
        )
    reading = Reading()
    for path, value in _keys(file.content):
        key = key_of(path)
        if key is None:
            reading.unknown.append(path)
        elif key.convert is None:
            reading.ignored[path] = key.note
        elif not any(flag in flags for flag in key.flags):
            reading.ignored[path] = f"`tokenrelay {command}` has no {key.flags[0]}"
        else:
            try:
                given = key.convert(value, file)
            except Ignored as why:
                reading.ignored[path] = str(why)
                continue
            except ValueError as error:
                raise CannotStart(f"{path}: {error}") from None
            if given is not None:
                argument, parsed = _checked(flags[key.flags[0]], given, path)
                reading.arguments += argument
                reading.settings[path] = (key.flags[0], " ".join([key.flags[0], *given]), parsed)
    return reading


def _checked(action: argparse.Action, given: list[str], path: str) -> tuple[list[str], Any]:
    """`given` as arguments of `action`'s flag, and as its parsing has them; its refusal names the key."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch
        return [flag], True
    try:
        parsed = [action.type(text) if action.type else text for text in given]
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise CannotStart(f"{path}: {error} ({flag})") from None
    if action.nargs == "+":
        return [flag, *given], parsed
    return [f"{flag}={given[0]}"], parsed[0]  # one argument, even where the value begins with "-"


def _keys(content: dict) -> Iterator[tuple[str, Any]]:
    """Each key of the file that is no section, with its JSON path: "ServerConfig.port", "...ModelConfig[0].x"."""

    def walk(node: dict, at: str) -> Iterator[tuple[str, Any]]:
        for name, value in node.items():
            path = f"{at}.{name}" if at else name
            if path in SECTIONS:
                if not isinstance(value, dict):
                    raise CannotStart(f"{path}: an object of keys, not {value!r}")
                yield from walk(value, path)
            elif path == MODELS:
                if not (isinstance(value, list) and all(isinstance(entry, dict) for entry in value)):
                    raise CannotStart(f"{path}: a list of objects, one per model, not {value!r}")
                for index, entry in enumerate(value):
                    yield from walk(entry, f"{path}[{index}]")
            else:
                yield path, value

    return walk(content, "")
