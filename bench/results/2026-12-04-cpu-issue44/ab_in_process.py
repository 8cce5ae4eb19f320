"""Issue 44's in-process A/B: one state dict, one process, the two variants of a rule
alternated in ABBA order, the aligned-writer limit (saves) or torch.load (loads) in every pair.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44/ab_in_process.py \
        --what heads|reads --dir bench/out --size 1GiB --pairs 6

heads: save with the misaligned heads split off (the kept rule) / without (the split disabled).
reads: load (plain, and into= live tensors) with direct reads where O_DIRECT needs 512-byte
aligned memory (the reader's rule lifted) / without (the kept rule: staged there).
One process, so both variants meet the same allocations; the machine is shared, so only the
pairs' ratios mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

import gds_persist
from bench.bench_io import parse_size
from bench.bench_limit import AlignedLimit
from bench.machine import drop_page_cache
from bench.state import iter_tensors, make_state_dict
from gds_persist.saving import directory
from gds_persist.transfer import reader

_heads = directory.DirectoryLayout._heads


def variant(what: str, on: bool) -> None:
    if what == "heads":
        directory.DirectoryLayout._heads = (  # type: ignore[method-assign]
            _heads if on else (lambda self, run: None))
    else:
        reader.DIRECT_READ_MAX_ALIGNMENT = 64 if on else 4096


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=("heads", "reads"), required=True)
    p.add_argument("--dir", default="bench/out")
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--pairs", type=int, default=6)
    a = p.parse_args()
    work = os.path.join(a.dir, f"ab44-{os.getpid()}")
    os.makedirs(work)
    sd = make_state_dict(a.size, seed=0)
    tensors = [t for _, t in iter_tensors(sd)]
    live = {k: torch.zeros_like(v) for k, v in iter_tensors(sd)}
    limit = AlignedLimit(work, tensors, gds_persist.settings.current().io_threads)
    ck, pt = os.path.join(work, "ck"), os.path.join(work, "ref.pt")
    if a.what == "reads":
        torch.save(sd, pt)
    rows: dict[str, list[float]] = {}

    def timed(name: str, fn: object, cold: bool = True) -> None:
        os.sync()
        if cold:
            drop_page_cache([work], "auto")
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        rows.setdefault(name, []).append(time.perf_counter() - t0)

    def save_once(on: bool) -> None:
        variant(a.what, on)
        shutil.rmtree(ck, ignore_errors=True)
        timed("save " + ("kept" if on else "other"), lambda: gds_persist.save(sd, ck), False)

    def load_once(on: bool) -> None:
        variant(a.what, on)
        tag = "kept" if on else "other"
        timed("load " + tag, lambda: gds_persist.load(ck))
        timed("into " + tag, lambda: gds_persist.load(ck, into=live))

    for i in range(a.pairs + 1):  # pair 0: warm-up, not kept
        order = (True, False) if i % 2 == 0 else (False, True)
        if a.what == "heads":
            for on in order:
                save_once(on)
            w = limit.write()
            limit.cleanup()
            rows.setdefault("limit", []).append(w.seconds)
        else:
            if i == 0:
                save_once(True)
            for on in order:
                load_once(on)
            timed("torch.load", lambda: torch.load(pt, weights_only=True))
        if i == 0:
            rows = {}
    limit.close()
    shutil.rmtree(work)
    gb = limit.nbytes / 1e9
    for name, secs in rows.items():
        print(f"{name:12} median {gb / statistics.median(secs):5.2f} GB/s  "
              + " ".join(f"{gb / s:5.2f}" for s in secs))
    base = "limit" if a.what == "heads" else "torch.load"
    for name, secs in rows.items():
        if name != base:
            r = [b / s for s, b in zip(secs, rows[base], strict=True)]
            print(f"{name:12} x {base}: median {statistics.median(r):.2f}  "
                  + " ".join(f"{v:.2f}" for v in r))


if __name__ == "__main__":
    main()
