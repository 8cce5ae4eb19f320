"""The least work a memory-tier restore does, measured on this machine: ``ranks`` processes at once,
each reading ``size`` bytes from a file of its own in the memory directory (tmpfs) into its own
memory and checksumming them (CRC32C), as every rank of a restore from memory must at the least,
with a restore's queue depth. Into fresh private memory (a restore into new tensors: every page
faulted in and zeroed first) or into memory touched beforehand (``into``: a restore in place
into the live state). Until 2026-12-03 the processes read one shared file into shared (shmem)
pages, which made this "floor" 0.63-0.80 s where a real memory restore took 0.68 s.

No restore from memory can be faster than this floor, so ``drive restore / floor`` bounds how
many times faster than the drive a memory restore can be on this machine
(bench/bench_recovery.py prints it beside the target).

    python bench/memory_floor.py [--size 256MiB] [--ranks 4] [--into] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import crc32c

BLOCK = 16 << 20  # bytes per read, as the restore's block_bytes


def child(path: str, size: int, into: bool, threads: int) -> None:
    """One rank: wait for "go" on stdin, read and checksum the file in ``BLOCK`` requests,
    ``threads`` at once (a restore's own queue depth: no faster on 2 cores, but where cores are
    many a restore's threads read in parallel, and so must its floor's); print the seconds."""
    # fresh private pages, as a tensor's (mmap's default, MAP_SHARED, is shmem: its page faults
    # took 1.4x as long as torch.empty's here, and the floor came out above a real restore)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if into:
        buf[::4096] = b"\1" * len(range(0, size, 4096))  # every page touched, as a live state's
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)

    def block(offset: int) -> int:
        piece = view[offset : offset + BLOCK]
        got = os.preadv(fd, [piece], offset)
        return crc32c.crc32c(piece[:got])

    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        crcs = list(pool.map(block, range(0, size, BLOCK)))
    seconds = time.perf_counter() - start
    os.close(fd)
    view.release()
    print(f"{seconds:.6f} {sum(crcs)}", flush=True)  # the CRCs printed: computed, not skipped


def measure(directory: str, size: int, ranks: int, into: bool, rounds: int = 3,
            threads: int | None = None) -> float:
    """The slowest rank's seconds, median over ``rounds`` (a round: ``ranks`` at once), each
    reading ``threads`` requests at once (default: a restore's, ``settings.io_threads``)."""
    if threads is None:
        from gds_persist import settings

        threads = settings.current().io_threads
    paths = [_random_file(directory, size) for _ in range(ranks)]  # a copy each, as a node's
    try:  # shares are (two ranks of a node read the same file: one file for all was slower)
        return statistics.median(_round(paths, size, into, threads) for _ in range(rounds))
    finally:
        for path in paths:
            os.unlink(path)


def _random_file(directory: str, size: int) -> str:
    fd, path = tempfile.mkstemp(prefix="gds_persist-floor-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        for _ in range(0, size, BLOCK):
            f.write(os.urandom(min(BLOCK, size - f.tell())))
    return path


def _round(paths: list[str], size: int, into: bool, threads: int) -> float:
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", path,
                               "--size", str(size), "--threads", str(threads)]
                              + (["--into"] if into else []), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for path in paths]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        seconds = [float(p.communicate(timeout=300)[0].split()[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a floor process failed: {[p.returncode for p in procs]}")
    return max(seconds)


def main(argv: list[str] | None = None) -> float:
    from bench.bench_io import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=256 << 20)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--into", action="store_true")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="requests at once per process (default: the "
                   "restore's, gds_persist.settings io_threads)")
    args = p.parse_args(argv)
    seconds = measure(args.dir, args.size, args.ranks, args.into, args.rounds, args.threads)
    print(f"{args.ranks} processes x {args.size / 2**20:.0f} MiB from {args.dir} into "
          f"{'touched' if args.into else 'fresh'} memory + CRC32C: {seconds:.3f} s")
    return seconds


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[4]), "--into" in sys.argv, int(sys.argv[6]))
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        main()
