"""The least work a memory-tier restore does, measured on this machine: ``ranks`` processes at once,
each reading ``size`` bytes from a file in the memory directory (tmpfs) into its own memory and
checksumming them (CRC32C), as every rank of a restore from memory must at the least. Into fresh
memory (a restore into new tensors: every page faulted in and zeroed first) or into memory
touched beforehand (``into``: a restore in place into the live state).

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

import crc32c

BLOCK = 16 << 20  # bytes per read, as the restore's block_bytes


def child(path: str, size: int, into: bool) -> None:
    """One rank: wait for "go" on stdin, read and checksum the file; print the seconds."""
    buf = mmap.mmap(-1, size)  # fresh pages, faulted in by the read (a bytearray is zeroed)
    if into:
        buf[::4096] = b"\1" * len(range(0, size, 4096))  # every page touched, as a live state's
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    crc, done = 0, 0
    while done < size:
        got = os.preadv(fd, [view[done : done + BLOCK]], done)
        crc = crc32c.crc32c(view[done : done + got], crc)
        done += got
    seconds = time.perf_counter() - start
    os.close(fd)
    view.release()
    print(f"{seconds:.6f} {crc}", flush=True)


def measure(directory: str, size: int, ranks: int, into: bool, rounds: int = 3) -> float:
    """The slowest rank's seconds, median over ``rounds`` (a round: ``ranks`` at once)."""
    fd, path = tempfile.mkstemp(prefix="gds_persist-floor-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(0, size, BLOCK):
                f.write(os.urandom(min(BLOCK, size - f.tell())))
        return statistics.median(_round(path, size, ranks, into) for _ in range(rounds))
    finally:
        os.unlink(path)


def _round(path: str, size: int, ranks: int, into: bool) -> float:
    args = [sys.executable, os.path.abspath(__file__), "--child", path, "--size", str(size)]
    procs = [subprocess.Popen(args + (["--into"] if into else []), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
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
    args = p.parse_args(argv)
    seconds = measure(args.dir, args.size, args.ranks, args.into, args.rounds)
    print(f"{args.ranks} processes x {args.size / 2**20:.0f} MiB from {args.dir} into "
          f"{'touched' if args.into else 'fresh'} memory + CRC32C: {seconds:.3f} s")
    return seconds


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[4]), "--into" in sys.argv)
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        main()
