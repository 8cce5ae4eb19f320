"""``gds-persist import FILE PATH``: adopt a torch.save or safetensors file as a checkpoint.

torch files are read with torch.load(weights_only=True) only: nothing in them can run code.
"""

from __future__ import annotations

import argparse

from ...progress import cli_progress

HELP = "save a torch.save or safetensors file as a checkpoint"
DESCRIPTION = __doc__.split("\n")[0] + " " + __doc__.split("\n")[2]


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a torch.save file (.pt/.bin) or a .safetensors file")
    p.add_argument("path", help="checkpoint directory to write (replaced atomically)")
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", "torch", "safetensors"),
        help="input format (default: detected from the file's first bytes)",
    )
    p.add_argument("--backend", default=None, help="auto (default), direct, buffered or kvikio")


def run(args: argparse.Namespace) -> int:
    from ...convert.importing import import_checkpoint

    bar = cli_progress("import")
    try:
        info = import_checkpoint(
            args.file, args.path, format=args.format, backend=args.backend, progress=bar
        )
    finally:
        if bar is not None:
            bar.close()
    print(
        f"imported {args.file} -> {info.path}: {info.tensors} tensors in {info.storages} "
        f"storages, {info.bytes_written} bytes, backend {info.backend} ({info.seconds:.2f} s)"
    )
    return 0
