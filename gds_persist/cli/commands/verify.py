"""``gds-persist verify PATH``: re-read every extent and check its CRC32C."""

from __future__ import annotations

import argparse
import sys
import time

from ...loading.verify import verify
from ...progress import cli_progress

HELP = ("re-read and checksum every extent; exit 1 on any mismatch, 3 when the file records "
        "no checksums")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--backend", default=None, help="auto (default), direct or buffered")
    p.add_argument("--data-dir", action="append", default=[], metavar="RECORDED=NOW",
                   help="a data directory that moved since the save (repeatable)")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    moved = dict(d.split("=", 1) for d in args.data_dir if "=" in d)
    bar = cli_progress("verify")  # only on a terminal
    try:
        report = verify(args.path, backend=args.backend, progress=bar, data_dirs=moved or None)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    for error in report.errors:
        print(f"MISMATCH: {error}", file=sys.stderr)
    if not report.verified:
        print(f"NOT VERIFIED: {report.path} records no checksums (a safetensors file, or a "
              "torch.save file written without CRCs): nothing could be checked")
        return 3
    status = "OK" if report.ok else f"FAILED ({len(report.errors)} corrupted extents)"
    extra = ""
    if report.referenced_bytes or report.encoded_extents:
        extra = (f" ({report.referenced_bytes} of them held by base checkpoints; "
                 f"{report.encoded_extents} encoded extents checked stored and decoded)")
    print(f"{status}: {report.path}: {report.extents} extents in {report.files} files, "
          f"{report.bytes_checked} bytes checked ({report.checksum}){extra} in {seconds:.2f} s")
    return 0 if report.ok else 1
