"""``gds-persist verify PATH``: re-read every extent and check its CRC32C."""

from __future__ import annotations

import argparse
import sys
import time

from ...loading.verify import verify
from ...progress import cli_progress

HELP = ("re-read and checksum every extent; exit 0 when all match, 1 on a mismatch, 2 when it "
        "cannot be read, 3 when it records no checksums")
DESCRIPTION = """Re-read every extent of a checkpoint (a directory, a torch.save or a safetensors
file) and check its CRC32C.

exit status:
  0  every extent read back and matched its checksum
  1  at least one extent did not match (each is printed, naming its tensor, file and offset)
  2  the checkpoint could not be read: missing, not committed, a data file truncated or
     missing, a manifest that does not validate (the error names which, and what to do)
  3  the file records no checksums (a safetensors file, or a torch.save file written without
     CRCs): nothing could be checked
"""
FORMATTER = argparse.RawDescriptionHelpFormatter


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
