"""``gds-persist materialize PATH OUT``: a standalone copy of a checkpoint (every byte it refers
to in base checkpoints copied in, every stored byte checked)."""

from __future__ import annotations

import argparse

from ...convert.materialize import materialize
from ...progress import cli_progress

HELP = "copy a checkpoint into a standalone one (no references to base checkpoints)"
DESCRIPTION = ("Write a copy of the checkpoint at PATH to the directory OUT that holds "
               "every byte itself: an incremental checkpoint's referred bytes are copied from "
               "its bases, encoded extents stay encoded, every stored byte is checked against "
               "its CRC32C.")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("out", help="output checkpoint directory (replaced atomically if it exists)")


def run(args: argparse.Namespace) -> int:
    bar = cli_progress("materialize")
    try:
        info = materialize(args.path, args.out, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    print(f"materialized {args.path} -> {info.out}: {info.tensors} tensors, "
          f"{info.bytes_written} bytes")
    for note in info.notes:
        print(f"  note: {note}")
    return 0
