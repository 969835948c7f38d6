"""A benchmark's `--help`: its description as written, and the default of every option that has one.

A default is said once: appended as `(default: VALUE)` unless the option's
help already says it in its own words (`default: the bundled model`). An
option whose default is nothing (None, off, empty) has nothing to say.
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
