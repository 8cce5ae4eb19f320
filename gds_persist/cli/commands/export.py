"""``gds-persist export PATH --to torch|safetensors OUT``: write a checkpoint as a torch.save or
safetensors file (every CRC32C verified; the output appears atomically)."""

from __future__ import annotations

import argparse
import sys

from ...progress import cli_progress

HELP = "write a checkpoint as a torch.save (.pt) or safetensors file"
DESCRIPTION = ("Write the checkpoint at PATH to OUT. --to torch: loads with "
               "torch.load(OUT, weights_only=True). --to safetensors: loads with "
               "safetensors.torch.load_file(OUT); nested keys are joined with --sep, and "
               "non-tensor values, tied tensors and parameters are kept in the file's "
               "metadata for 'gds-persist import'.")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory (gds_persist.save or the DCP writer)")
    p.add_argument("--to", required=True, choices=("torch", "safetensors"), help="output format")
    p.add_argument("out", help="output file")
    p.add_argument("--sep", default=".", help="safetensors key separator (default '.')")
    p.add_argument("--backend", default=None, help="auto (default), direct or buffered")


def run(args: argparse.Namespace) -> int:
    from ...convert.export import export_checkpoint

    bar = cli_progress(f"export {args.to}")
    try:
        info = export_checkpoint(
            args.path, args.out, to=args.to, sep=args.sep, backend=args.backend, progress=bar
        )
    finally:
        if bar is not None:
            bar.close()
    print(
        f"exported {args.path} -> {info.out} ({info.to}): {info.tensors} tensors, "
        f"{info.bytes_written} bytes"
    )
    for note in info.notes:
        print(f"  note: {note}", file=sys.stderr)
    return 0
