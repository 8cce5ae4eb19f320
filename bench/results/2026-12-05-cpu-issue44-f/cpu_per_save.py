"""CPU seconds (user + system, getrusage) and wall time of a 1 GiB save on tmpfs beside the
aligned writer, the checksummed writer, and the same save with its CRC32C replaced by a constant
(what the checksum costs the save); shuffled rounds, a pause before each; medians.

    PYTHONPATH=. python bench/results/2026-12-05-cpu-issue44-f/cpu_per_save.py DIR [ROUNDS]

(issue44-c's cpu_per_save.py, with the checksummed writer added and the CRC replaced in the
staged path too.)
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import statistics
import sys
import time

import gds_persist
from bench.bench_limit import AlignedLimit
from bench.state import iter_tensors, make_state_dict
from gds_persist.format import checksum
from gds_persist.transfer import pipeline, writer


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def no_crc(data: object, value: int = 0) -> int:
    return 0


def main(directory: str, rounds: int) -> None:
    os.makedirs(directory, exist_ok=True)
    sd = make_state_dict(1 << 30, seed=0)
    tensors = [t for _, t in iter_tensors(sd)]
    limits = {"aligned writer": AlignedLimit(directory, tensors, 4),
              "checksummed writer": AlignedLimit(directory, tensors, 4, checksum=True)}
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for name in random.sample([*limits, "save", "save, CRC a constant"], 4):
            time.sleep(0.5)
            crc = no_crc if name.endswith("constant") else checksum.crc32c
            writer.crc32c = pipeline.crc32c = crc
            c0, t0 = cpu_seconds(), time.perf_counter()
            if name in limits:
                limits[name].write()
            else:
                gds_persist.save(sd, f"{directory}/ck")
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            for limit in limits.values():
                limit.cleanup()
            shutil.rmtree(f"{directory}/ck", ignore_errors=True)
            rows.setdefault(name, []).append((wall, cpu))
    writer.crc32c = pipeline.crc32c = checksum.crc32c
    for limit in limits.values():
        limit.close()
    print(f"host CRC32C: {checksum.IMPLEMENTATION}; {rounds} rounds, medians")
    for name, v in rows.items():
        print(f"{name:21} wall {statistics.median(x[0] for x in v):.3f} s, "
              f"cpu {statistics.median(x[1] for x in v):.3f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    os.sync()
