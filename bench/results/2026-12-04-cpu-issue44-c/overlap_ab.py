"""The checksum beside the write against the checksum first, paired with the aligned writer of as
many threads, in one process: ABBA rounds of (aligned writer, save with the CRC first, save with
the CRC beside the write), 1 GiB.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-c/overlap_ab.py DIR PAIRS IO_THREADS

The "CRC first" arm hands ``FileWriter._write_direct`` no checksum threads (what the library
does where the cores are busy); the other arm gets them where ``usable_cores() >= 2 x
IO_THREADS`` (1 I/O thread on these 2 cores).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import gds_persist
from bench.bench_limit import AlignedLimit
from bench.state import iter_tensors, make_state_dict
from gds_persist.transfer import writer


def main(directory: str, pairs: int, threads: int) -> None:
    sd = make_state_dict(1 << 30, seed=0)
    limit = AlignedLimit(directory, [t for _, t in iter_tensors(sd)], threads)
    real = writer.FileWriter._write_direct
    beside = {"on": True}

    def write_direct(self, f, seg, hosts, sources, checksums=None):  # type: ignore[no-untyped-def]
        return real(self, f, seg, hosts, sources, checksums if beside["on"] else None)

    writer.FileWriter._write_direct = write_direct  # type: ignore[method-assign]
    seconds: dict[str, list[float]] = {}

    def once(name: str) -> None:
        os.sync()
        t0 = time.perf_counter()
        if name == "limit":
            limit.write()
        else:
            beside["on"] = name == "beside"
            with gds_persist.settings.set(io_threads=threads):
                gds_persist.save(sd, f"{directory}/ck")
        seconds.setdefault(name, []).append(time.perf_counter() - t0)
        limit.cleanup()
        shutil.rmtree(f"{directory}/ck", ignore_errors=True)

    names = ("limit", "crc-first", "beside")
    for name in names:  # warm-up, not kept
        once(name)
    seconds.clear()
    for r in range(pairs):
        for name in (names if r % 2 == 0 else names[::-1]):
            once(name)
    limit.close()
    for name, v in seconds.items():
        ratios = [lim / s for lim, s in zip(seconds["limit"], v, strict=True)]
        print(f"io_threads {threads} {name:9} {limit.nbytes / statistics.median(v) / 1e9:.2f} "
              f"GB/s; x limit per pair {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
