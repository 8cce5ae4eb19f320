"""CPU seconds (user + system, getrusage) and wall time of the aligned writer, a save, and a save
whose CRC32C is replaced by a constant (what the checksum costs), 1 GiB, alternated 5 times.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-c/cpu_per_save.py DIR
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import time

import gds_persist
from bench.bench_limit import AlignedLimit
from bench.state import iter_tensors, make_state_dict
from gds_persist.transfer import writer


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(directory: str, rounds: int = 5) -> None:
    sd = make_state_dict(1 << 30, seed=0)
    limit = AlignedLimit(directory, [t for _, t in iter_tensors(sd)], 4)
    real_crc = writer.crc32c
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for name in ("limit", "save", "save-nocrc"):
            os.sync()
            c0, t0 = cpu_seconds(), time.perf_counter()
            if name == "limit":
                limit.write()
            else:
                writer.crc32c = real_crc if name == "save" else (lambda data, value=0: 0)
                gds_persist.save(sd, f"{directory}/ck")
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            limit.cleanup()
            shutil.rmtree(f"{directory}/ck", ignore_errors=True)
            rows.setdefault(name, []).append((wall, cpu))
    writer.crc32c = real_crc
    limit.close()
    for name, v in rows.items():
        print(f"{name:11} wall {statistics.median(x[0] for x in v):.3f} s, "
              f"cpu {statistics.median(x[1] for x in v):.3f} s")


if __name__ == "__main__":
    main(sys.argv[1])
