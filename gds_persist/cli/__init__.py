"""The ``gds-persist`` command. Each subcommand lives in ``gds_persist/cli/commands/<name>.py`` (a
trailing ``_`` is dropped from the command's name) and defines ``HELP``, optionally
``DESCRIPTION`` and ``FORMATTER``, ``arguments(parser)`` and ``run(args) -> exit status``; they are
discovered, so adding one touches no shared file."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from ..errors import CheckpointError
from . import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gds-persist", description="Inspect, verify, convert and plan gds_persist "
        "checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        command = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(info.name.rstrip("_"), help=command.HELP,
                           description=getattr(command, "DESCRIPTION", None),
                           formatter_class=getattr(command, "FORMATTER", argparse.HelpFormatter))
        command.arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CheckpointError as e:
        print(f"gds-persist {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
