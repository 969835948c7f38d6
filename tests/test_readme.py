"""The README and the pages of docs/ against the code: flags, defaults, commands, routes.

The flag tables (every table whose first column is `flag`: docs/settings.md's,
and any other page's) have four columns: the flags, the commands that take
them, their defaults, and what they do. Read this way:

- flags: the backquoted `--flags` of the first cell; one followed by
  "(env `NAME`)" reads its environment variable from NAME, every other one
  from TOKENRELAY_<FLAG>, as its --help must say;
- commands: comma-separated subcommands of `tokenrelay`; over all rows that
  name a flag, exactly the subcommands (bench aside) that have it;
- defaults: one per flag, comma-separated (commas inside parentheses do not
  count). A trailing "(...)" is a note for readers and is not compared.
  What is left is one of:
    `off` / `on`          a store_true flag, False / True
    `none`                None, "" or [] (not given)
    `required`            the flag must be given
    `the bundled model`   workers.bundled.BUNDLED_MODEL
    `X on CPU / Y on GPU` the default is 0, and --help says "0: X on the CPU, Y on a GPU"
    a number and a unit   the default equals number x unit, and the unit is the flag's:
                          `s` (--help speaks of seconds), `ms` (the flag ends in -ms),
                          `MB` (--help says MB), `MiB` (2^20; the flag ends in -bytes)
    anything else         the default, as a string

The parser is built with every TOKENRELAY_* variable and
ALLOWED_MEDIA_DOMAINS_ENV removed, since defaults come from the environment.
Every `tokenrelay <command> --flag ...` in the code of the README and of every
page (blocks, and inline code that starts with `tokenrelay `) must name a real
subcommand and its flags (for `bench`, a real benchmark; their flags live in
each benchmark's own parser, not checked here).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from tokenrelay import api_doc

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
SETTINGS = DOCS / "settings.md"
PAGES = (README, *sorted(DOCS.glob("*.md")))
COMMANDS = ("serve", "gateway", "worker", "simulate", "up")


@pytest.fixture
def subcommands(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    """`tokenrelay`'s subparsers by name, with defaults free of the environment."""
    for name in list(os.environ):
        if name.startswith("TOKENRELAY_") or name == "ALLOWED_MEDIA_DOMAINS_ENV":
            monkeypatch.delenv(name)
    from tokenrelay.flags.commands import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _split_top(cell: str) -> list[str]:
    """`cell` split at ", " outside parentheses and backquotes."""
    parts, depth, quoted, current = [], 0, False, ""
    for i, char in enumerate(cell):
        if char == "`":
            quoted = not quoted
        elif not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
        if char == "," and depth == 0 and not quoted and cell[i + 1 : i + 2] == " ":
            parts.append(current.strip())
            current = ""
            continue
        current += char
    return [*parts, current.strip()]


def flag_rows(text: str) -> list[tuple[list[tuple[str, str | None]], list[str], list[str]]]:
    """Each row of each flag table: [(flag, env or None)], commands, defaults."""
    rows = []
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if cells[0] == "flag":
            in_table = True
            assert cells[1:3] == ["commands", "default"], f"a flag table's columns: flag, commands, default: {line}"
            continue
        if not in_table or set(cells[0]) <= {"-", ":", "|"}:
            continue
        flags = re.findall(r"`(--[a-z0-9-]+)`(?:\s*\(env `([A-Z0-9_]+)`\))?", cells[0])
        commands = [command.strip() for command in cells[1].split(",")]
        rows.append(([(flag, env or None) for flag, env in flags], commands, _split_top(cells[2])))
    return rows


_UNITS = {
    "s": (1, lambda flag, help: "second" in help),
    "ms": (1, lambda flag, help: flag.endswith("-ms")),
    "MB": (1, lambda flag, help: "MB" in help),
    "MiB": (2**20, lambda flag, help: flag.endswith("-bytes")),
}


def default_problem(flag: str, stated: str, action: argparse.Action) -> str | None:
    """Why the parser's default for `flag` is not what the table's cell `stated` says; None if it is."""
    value = stated.replace("`", "").strip()
    note = re.fullmatch(r"(.+?)\s*\(.*\)", value)
    if note:
        value = note.group(1)
    help = " ".join((action.help or "").split())
    default = action.default
    wrong = f"{flag}: the table says {stated!r}, the parser's default is {default!r}"
    if value in ("off", "on"):
        return None if action.nargs == 0 and default is (value == "on") else wrong
    if value == "none":
        return None if default in (None, "", []) and not action.required else wrong
    if value == "required":
        return None if action.required else f"{flag}: the table says required, the parser does not require it"
    if value == "the bundled model":
        from workers.bundled import BUNDLED_MODEL

        return None if default == str(BUNDLED_MODEL) else wrong
    auto = re.fullmatch(r"(.+) on CPU / (.+) on GPU", value)
    if auto:
        said = f"0: {auto.group(1)} on the CPU, {auto.group(2)} on a GPU"
        if default != 0 or said not in help:
            return f"{wrong}, and its help should say {said!r}: {help!r}"
        return None
    number = re.fullmatch(r"(-?[0-9]+(?:\.[0-9]+)?)(?:\s+(\S+))?", value)
    if number:
        amount, unit = number.groups()
        scale = 1
        if unit is not None:
            if unit not in _UNITS:
                return f"{flag}: unknown unit {unit!r} in {stated!r}"
            scale, fits = _UNITS[unit]
            if not fits(flag, help):
                return f"{flag}: {unit!r} is not this flag's unit ({help!r})"
        if isinstance(default, bool) or not isinstance(default, int | float):
            return wrong
        return None if float(amount) * scale == float(default) else wrong
    return None if default == value else wrong


def settings_problems(text: str, subcommands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Every way the flag tables of `text` disagree with the parser."""
    problems: list[str] = []
    where: dict[str, set[str]] = {}
    rows = flag_rows(text)
    if not rows:
        return ["no flag table found"]
    for flags, commands, defaults in rows:
        if len(defaults) != len(flags):
            problems.append(f"{[f for f, _ in flags]}: {len(defaults)} defaults for {len(flags)} flags: {defaults}")
            continue
        for (flag, env), stated in zip(flags, defaults, strict=True):
            where.setdefault(flag, set())
            for command in commands:
                if command not in subcommands:
                    problems.append(f"{flag}: `tokenrelay {command}` is no command")
                    continue
                action = _actions(subcommands[command]).get(flag)
                if action is None:
                    problems.append(f"{flag}: `tokenrelay {command}` has no such flag")
                    continue
                where[flag].add(command)
                problem = default_problem(flag, stated, action)
                if problem:
                    problems.append(f"tokenrelay {command} {problem}")
                variable = env or "TOKENRELAY_" + flag[2:].replace("-", "_").upper()
                if not re.search(rf"\(env {re.escape(variable)}[;)]", action.help or ""):
                    problems.append(f"tokenrelay {command} {flag}: its help does not name the variable {variable}")
    for flag, listed in where.items():
        having = {command for command in COMMANDS if flag in _actions(subcommands[command])}
        if listed and listed != having:
            problems.append(f"{flag}: the table lists {sorted(listed)}, the commands that take it are {sorted(having)}")
    return problems


def command_lines(text: str) -> list[str]:
    """Every `tokenrelay ...` command `text` shows: in code blocks, and inline code that starts with it."""
    lines: list[str] = []
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    blocks += re.findall(r"(?:^\n)((?:^    \S.*\n)+)", text, flags=re.M)  # indented code blocks
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#.*", "", line)
            lines += re.findall(r"(?:^|[;&|]\s*|\.venv/bin/)(tokenrelay\s+[a-z].*?)(?=\s&|\s\||;|$)", line.strip())
    for span in re.findall(r"`(tokenrelay [^`]+)`", text):
        lines.append(" ".join(span.split()))
    return lines


def command_line_problems(text: str, subcommands: dict[str, argparse.ArgumentParser]) -> list[str]:
    problems: list[str] = []
    benchmarks = next(a for a in subcommands["bench"]._actions if a.dest == "benchmark").choices
    for line in command_lines(text):
        words = line.split()
        for command in words[1].split("|"):  # `tokenrelay serve|gateway|worker --help`
            if command not in subcommands:
                problems.append(f"{line!r}: `tokenrelay {command}` is no command")
                continue
            if command == "bench":
                if len(words) < 3 or words[2] not in benchmarks:
                    problems.append(f"{line!r}: no such benchmark (one of {', '.join(benchmarks)})")
                continue
            known = _actions(subcommands[command])
            for flag in re.findall(r"(?<!\S)(--[a-z0-9-]+)", line):
                if flag not in known:
                    problems.append(f"{line!r}: `tokenrelay {command}` has no flag {flag}")
    return problems


def test_settings_table_matches_the_parser(subcommands):
    assert flag_rows(SETTINGS.read_text(encoding="utf-8")), "docs/settings.md has the flag table"
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        if flag_rows(text):
            problems = settings_problems(text, subcommands)
            assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("planted", "replacement"),
    [
        ("| 1.5 s |", "| 2 s |"),  # a wrong number
        ("| 40 MB |", "| 40 s |"),  # a unit that is not the flag's
        ("| 64 on CPU / 256 on GPU, 2560,", "| 64 on CPU / 256 on GPU, 4096,"),  # a wrong one among several
        ("| 64 on CPU / 256 on GPU,", "| 32 on CPU / 256 on GPU,"),  # the CPU's value in the help differs
        ("| 16 MiB |", "| 16 MB |"),
        ("| serve, gateway, worker, simulate | 30 s |", "| serve, gateway, worker, simulate | 30 ms |"),
        ("| `--no-router` | serve, gateway | off |", "| `--no-router` | serve, gateway | on |"),
        ("| gateway, worker, simulate | required |", "| gateway, worker, simulate | none |"),
        ("| `--no-router` | serve, gateway |", "| `--no-routing` | serve, gateway |"),  # no such flag
        ("| `--no-router` | serve, gateway |", "| `--no-router` | serve |"),  # a command left out
        ("| `--no-router` | serve, gateway |", "| `--no-router` | serve, gateway, worker |"),  # one without it
        ("(env `ALLOWED_MEDIA_DOMAINS_ENV`)", "(env `ALLOWED_MEDIA_DOMAINS`)"),  # a wrong variable
        ("`/data/multimodal_inputs`, none |", "`/data/multimodal_inputs` |"),  # a default missing
    ],
)
def test_a_wrong_table_fails(subcommands, planted, replacement):
    text = SETTINGS.read_text(encoding="utf-8")
    assert text.count(planted) == 1, f"docs/settings.md changed: plant {planted!r} elsewhere"
    assert settings_problems(text.replace(planted, replacement), subcommands)


def test_commands_shown_exist(subcommands):
    lines = command_lines(README.read_text(encoding="utf-8"))
    assert any(line.startswith("tokenrelay serve") for line in lines), "the README shows `tokenrelay serve`"
    for page in PAGES:
        problems = command_line_problems(page.read_text(encoding="utf-8"), subcommands)
        assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


def test_a_wrong_command_fails(subcommands):
    text = README.read_text(encoding="utf-8")
    for planted in ("tokenrelay up --gateways 2 --workers 3", "--worker-id w1"):
        assert planted in text
    assert command_line_problems(text.replace("--worker-id w1", "--worker-name w1"), subcommands)
    assert command_line_problems(
        text.replace("tokenrelay up --gateways 2", "tokenrelay start --gateways 2"), subcommands
    )
    assert command_line_problems("```\n.venv/bin/tokenrelay gateway --model x &\n```\n", subcommands)
    assert command_line_problems("`tokenrelay bench engines`", subcommands)


def test_the_first_paragraph_says_what_hardware_runs_it():
    first = README.read_text(encoding="utf-8").split("\n\n")[1]  # after the title
    words = " ".join(first.split())
    assert "NVIDIA GPUs with CUDA" in words and "any CPU" in words and "not on Ascend NPUs" in words, first


def test_readme_links_the_api_reference():
    text = README.read_text(encoding="utf-8")
    assert "(docs/api.md)" in text and (REPO / "docs" / "api.md").is_file()
    assert "../shared/spec/API.md" not in text, "a clone has no ../shared: link docs/api.md"


def test_api_doc_is_up_to_date():
    text = api_doc.DOC.read_text(encoding="utf-8")
    generated = api_doc.render(*api_doc.openapi_document())
    assert api_doc.updated(text, generated) == text, "docs/api.md is out of date: run python -m tokenrelay.api_doc"
    for route in ("/infer_token", "/v2/models/{model}/generate_stream", "/v1/chat/completions", "/generate", "/ws"):
        assert f"`{route}`" in generated


def test_api_doc_notices_a_changed_route():
    document, sockets = api_doc.openapi_document()
    generated = api_doc.render(document, sockets)
    document["paths"]["/v2/models/{model}/generate"]["post"]["description"] = "Something else."
    assert api_doc.render(document, sockets) != generated


# The README's "Where things are": a row per folder, which names what the folder holds.
PACKAGES = ("bus", "gateway", "schemas", "telemetry", "tokenrelay", "workers")


def folder_rows(readme: str) -> dict[str, set[str]]:
    """Each row's folder (`gateway/`) -> the backquoted names in its row."""
    section = readme.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if match := re.fullmatch(r"\| `([^`]+/)` \| (.*) \|", line):
            rows[match.group(1)] = set(re.findall(r"`([^`]+)`", match.group(2)))
    return rows


def _files(root: Path) -> list[Path]:
    """The files under `root` but Python's caches, relative to the repository."""
    return sorted(p.relative_to(REPO) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def folder_table_problems(readme: str) -> list[str]:
    """Where the table is not true: a package or module of the code, a test helper, a page of docs/ or a file of
    .ci/ that its folder's row does not name, and a module a row names that is not there."""
    rows, problems = folder_rows(readme), []

    def named(folder: str, name: str) -> None:
        if name not in rows.get(folder, set()):
            problems.append(f"{folder}{name} is not named in the row of {folder}")

    for package in PACKAGES:
        for folder in sorted({path.parent for path in _files(REPO / package) if path.suffix == ".py"}):
            row = f"{folder.as_posix()}/"
            if row not in rows:
                problems.append(f"no row for the package {row}")
                continue
            for module in sorted((REPO / folder).glob("*.py")):
                if module.name != "__init__.py":
                    named(row, module.name)
    for module in sorted((REPO / "tests").glob("*.py")):
        if not module.name.startswith("test_") and module.name != "__init__.py":
            named("tests/", module.name)
    for page in sorted(DOCS.glob("*.md")):
        if f"(docs/{page.name}" not in readme:
            problems.append(f"docs/{page.name} is not linked from the README")
    for path in _files(REPO / ".ci"):
        top = path.relative_to(".ci").parts[0]
        named(".ci/", top if len(path.parts) == 2 else f"{top}/")
    for row, names in rows.items():
        problems += [
            f"{row}{n} is named but not there" for n in names if _a_module(n) and not (REPO / row / n).is_file()
        ]
    return problems


def _a_module(name: str) -> bool:
    return name.endswith(".py") and "*" not in name


def test_the_folder_table_names_every_package_module_helper_page_and_ci_file():
    assert folder_table_problems(README.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "planted, replacement",
    [
        (", failover (`failover.py`)", ""),  # a module left out
        ("(`tgi.py`)", "(TGI)"),  # a route module left out
        ("| `workers/simulated/` |", "| workers/simulated |"),  # a package's row gone
        ("(docs/coming-from-mindie.md)", "(docs/)"),  # a page not linked
        ("`draft.py`", "`draught.py`"),  # a module named that is not there
        ("and `hold-memory`", "and hold-memory"),  # a file of .ci/ left out
    ],
)
def test_a_folder_table_that_is_not_true_fails(planted, replacement):
    text = README.read_text(encoding="utf-8")
    assert planted in text
    assert folder_table_problems(text.replace(planted, replacement))
