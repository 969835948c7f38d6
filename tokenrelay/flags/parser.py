"""A command's parser, whose every flag the environment may set too, and the checked types of flags' values.

Every flag can also come from the environment: `--served-model-name` is
`TOKENRELAY_SERVED_MODEL_NAME` (lists separated by commas, a switch as 1,
true, yes or on). An environment value is read as if its flag came first on
the command line, so it is checked exactly as the flag is (its type, its
choices, its range) and a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class Parser(argparse.ArgumentParser):
    """A command's parser that knows the environment variable of each flag, and names it in an error about a
    value that came from there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.environment: dict[str, argparse.Action] = {}  # variable -> the flag's action
        self.from_environment: dict[str, str] = {}  # flag -> its variable, for the values read from there

    def error(self, message: str):
        for flag, variable in self.from_environment.items():
            if message.startswith(f"argument {flag}:"):  # argparse's words: "argument --dtype: invalid choice..."
                message = f"{message} (from the environment: {variable})"
                break
        super().error(message)

    def environment_arguments(self, environ: Mapping[str, str]) -> list[str]:
        """The flags that `environ` sets, as command-line arguments."""
        arguments: list[str] = []
        for variable, action in self.environment.items():
            value = environ.get(variable)
            if value is None:
                continue
            flag = action.option_strings[0]
            if action.nargs == 0:  # a switch
                if value.strip().lower() not in _TRUE + _FALSE:
                    self.error(f"{variable}={value!r} is not a switch's value: 1, true, yes, on, or 0, false, no, off")
                given = [flag] if value.strip().lower() in _TRUE else []
            elif action.nargs == "+":
                given = [flag, *value.split(",")] if value else []  # empty: none, as if unset
            else:
                given = [f"{flag}={value}"]  # one argument, even when the value begins with "-"
            if given:
                self.from_environment[flag] = variable
            arguments += given
        return arguments


def env_name(flag: str) -> str:
    return "TOKENRELAY_" + flag.lstrip("-").replace("-", "_").upper()


def option(parser: Parser, flag: str, *, help: str, env: str = "", **kwargs) -> None:
    """A flag that TOKENRELAY_<FLAG> (or the variable named by `env`) may set instead."""
    env = env or env_name(flag)
    default = kwargs.get("default")
    shown = f"; default {default}" if default not in (None, "") else ""
    parser.environment[env] = parser.add_argument(flag, help=f"{help} (env {env}{shown})", **kwargs)


def number(kind: type[int] | type[float], low: float, high: float | None = None) -> Callable[[str], float]:
    """A flag's type: a number of `kind` from `low` (to `high`), refused outside that range, which the refusal
    names. Named as `kind` is, so that argparse calls what is no number an "invalid int value"."""

    def number(text: str) -> float:
        value = kind(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is below {low}" if high is None else f"{value} is not in [{low}, {high}]"
            )
        return value

    number.__name__ = kind.__name__
    return number


parallel_size = number(int, 1, 64)
at_least_zero, at_least_one = number(int, 0), number(int, 1)


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value
