"""A process killed mid-flush (tests/test_flush.py): ``python flush_worker.py SHARE_DIR DURABLE
STEP`` flushes the share alone and SIGKILLs itself once the writer has copied its first bytes
into the durable step's temporary directory."""

from __future__ import annotations

import os
import signal
import sys

from gds_persist.parallel.distributed import SoloComm
from gds_persist.training.tier import flush


def _die(n: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    share_dir, durable, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flush.flush_step(SoloComm(), [share_dir], durable, step, progress=_die)
    sys.exit("the flush ended: it was to be killed mid-way")
