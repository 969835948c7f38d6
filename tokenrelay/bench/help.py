"""A benchmark's `--help`: its description as written, and the default of every option that has one.

A default is said once: appended as `(default: VALUE)` unless the option's
help already says it in its own words (`default: the bundled model`). An
option whose default is nothing (None, off, empty) has nothing to say. The
workload's length ranges, which several benches draw, are declared here
once, so that they read alike everywhere.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        written = action.help or ""
        default = action.default
        nothing = default is None or default is False or default in ("", [], ()) or default is argparse.SUPPRESS
        if nothing or "default:" in written:  # 0 is a default to say; False (a switch off) is not
            return written
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{written} (default: {shown.replace('%', '%%')})".lstrip()


def add_length_range(parser: argparse.ArgumentParser, name: str, default: tuple[int, int], what: str) -> None:
    """`--NAME MIN MAX`: a range of token counts each request of the workload draws from."""
    parser.add_argument(f"--{name}", type=int, nargs=2, default=default, metavar=("MIN", "MAX"), help=what)
