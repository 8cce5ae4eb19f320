"""The ``gds-persist`` command. Each subcommand lives in ``gds_persist/cli/commands/<name>.py`` (a
trailing ``_`` is dropped from the command's name) and defines ``HELP``, optionally
``DESCRIPTION`` and ``FORMATTER``, ``arguments(parser)`` and ``run(args) -> exit status``; they are
discovered, so adding one touches no shared file. Help texts may quote names in reST's double
backticks (they are docstrings too): the help shows them without."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys

from .._version import __version__
from ..errors import CheckpointError
from . import commands

# the exit status of a process that SIGPIPE ended (128 + 13), what `cat file | head` leaves
BROKEN_PIPE_STATUS = 141


def plain(text: str | None) -> str | None:
    """Help text as a terminal shows it: ``name`` -> name (reST literals in docstrings)."""
    return None if text is None else re.sub(r"``([^`]+)``", r"\1", text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gds-persist", description="Inspect, verify, convert and plan gds_persist "
        "checkpoints.")
    parser.add_argument("--version", action="version", version=f"gds-persist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        command = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(info.name.rstrip("_"), help=plain(command.HELP),
                           description=plain(getattr(command, "DESCRIPTION", None)),
                           formatter_class=getattr(command, "FORMATTER", argparse.HelpFormatter))
        command.arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, value in vars(args).items():  # "~/ckpt" quoted or after "--out=": as a shell would
        if isinstance(value, str | list):
            setattr(args, name, _expand(value))
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a failure
        return status
    except BrokenPipeError:
        # the reader went away (`gds-persist inspect CKPT | head`): stop quietly, as cat does.
        # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    except CheckpointError as e:
        print(f"gds-persist {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _expand(value: str | list[object]) -> str | list[object]:
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return os.path.expanduser(value)


if __name__ == "__main__":
    sys.exit(main())
