"""The `tokenrelay` command: its line parsed (tokenrelay/flags/commands.py), then the command run.

What each command runs is imported only once its line is parsed, so `--help`
answers at once.
"""

from __future__ import annotations

import importlib
import sys

from tokenrelay.flags.commands import parse_args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from telemetry import logs  # after parsing: --help needs none of what follows

    if args.command == "bench":
        logs.configure("warning", process="bench", log_format=args.log_format)
        module = f"tokenrelay.bench.{args.benchmark}"
        try:
            importlib.import_module(module).main(args.options)
        except KeyboardInterrupt:  # Ctrl-C ends a benchmark (its processes stopped on the way out), quietly
            sys.exit(130)
        return
    if args.command == "usage":
        from tokenrelay import usage

        logs.configure("warning", process="usage", log_format=args.log_format)
        sys.exit(usage.main(args))
    logs.configure(args.log_level, process=args.command, log_format=args.log_format)
    if args.command == "up":
        from tokenrelay import topology

        sys.exit(topology.up(args))
    from tokenrelay.launch import launch

    launch(args)


if __name__ == "__main__":
    main()
