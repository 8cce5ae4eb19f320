"""What ``auto``'s measuring rounds see on a cold load: 14 loads of one 1 GiB checkpoint, plain
and ``into=`` live tensors alternately, each evicted from the page cache first; per load its time
and the rounds' order (BD: buffered first) and rates, from ``LoadInfo.reason``.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-c/probe_rounds.py bench/out
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import time

import gds_persist
from bench.state import iter_tensors, make_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "2026-12-04-cpu-issue44-loads"))
from paired_loads import evict  # noqa: E402

ROUNDS = re.compile(r"rounds (\w+) of .*?read (\w+) ([\d.]+) GB/s, (\w+) ([\d.]+) GB/s")


def main(directory: str) -> None:
    sd = {k: v for k, v in iter_tensors(make_state_dict(1 << 30, seed=0)) if "lm_head" not in k}
    ck = os.path.join(directory, "probe-rounds")
    shutil.rmtree(ck, ignore_errors=True)
    gds_persist.save(sd, ck)
    os.sync()
    live = {k: v.clone() for k, v in sd.items()}
    for i in range(14):
        evict([ck])
        into = i % 2 == 1
        t0 = time.perf_counter()
        got, info = gds_persist.load_with_info(ck, into=live if into else None)
        seconds = time.perf_counter() - t0
        m = ROUNDS.search(info.reason)
        print(f"{'into ' if into else 'plain'} {seconds:.3f} s  "
              + (" ".join(m.groups()) if m else info.reason))
        del got
        gc.collect()
    shutil.rmtree(ck)


if __name__ == "__main__":
    main(sys.argv[1])
