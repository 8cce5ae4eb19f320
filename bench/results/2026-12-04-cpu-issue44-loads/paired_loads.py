"""Paired loads against torch.load / safetensors, in one process, ABBA per comparison (issue 44).

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-loads/paired_loads.py \
        --dir bench/out --size 1GiB --pairs 4 [--warm] [--json OUT]

One flat state (the GPT-like state of bench/state.py, tied weight dropped, so safetensors takes
it) written four ways: the directory format, ``save(format="torch")``, ``save(format=
"safetensors")``, and ``torch.save`` + ``safetensors.torch.save_file``. Comparisons (A vs B, run
A B B A per pair, the checkpoint's files evicted before every load with posix_fadvise(DONTNEED)
unless ``--warm`` (then read once through the page cache); each load's pages are fresh or,
for into, live tensors already touched):

* ``dir``: ``gds_persist.load(dir)`` vs ``torch.load(torch.save file)``;
* ``pt``: ``gds_persist.load(gds .pt)`` vs ``torch.load`` of that same file;
* ``into``: ``load(dir, into=live)`` vs ``torch.load(mmap=True)`` + ``copy_`` into live;
* ``st``: ``load(gds .safetensors, into=live)`` vs ``load_file`` + ``copy_`` into live;
* ``placebo``: ``torch.load`` vs ``torch.load`` (the same load twice: the spread of a pair);
* ``files``: ``torch.load`` of the torch.save file vs of the gds .pt file (one reader, two files);
* ``stock``: ``gds_persist.load`` vs ``torch.load`` of the torch.save file (one file);
* ``dir-buffered``, ``into-buffered-mmap``: ``dir`` and ``into`` with ``backend="buffered"``;
* ``into-pt``, ``st-same``: ``into`` and ``st`` with both readers on one file (the gds .pt
  file; the gds safetensors file);
* candidates, the engine against itself: ``threads2``, ``direct``, ``buffered``,
  ``into-threads2``, ``into-buffered`` (``io_threads=2``, ``backend=...`` against the default);
  ``huge``, ``huge-pt`` (fresh buffers on huge pages or not) only in this script as of the
  commit that tried them (see the README: tried and dropped).

Prints per pair the ratio time(B)/time(A) (> 1: A faster) and the median per comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import gds_persist
from bench.bench_io import parse_size
from bench.state import iter_tensors, make_state_dict


def evict(paths: list[str]) -> None:
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(r, f) for r, _, fs in os.walk(p)
                                                for f in fs]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(paths: list[str]) -> None:
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(r, f) for r, _, fs in os.walk(p)
                                                for f in fs]
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass


def copy_into(live: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(got[k])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--warm", action="store_true")
    p.add_argument("--only", default="dir,pt,into,st,placebo")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = os.path.join(a.dir, "paired-loads")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sd = make_state_dict(a.size)
    flat = {k: t.contiguous().clone() for k, t in iter_tensors(sd) if k != "model.lm_head.weight"}
    del sd
    f = {n: os.path.join(work, n) for n in ("ck", "gds.pt", "gds.safetensors", "torch.pt",
                                            "stock.safetensors")}
    gds_persist.save(flat, f["ck"])
    gds_persist.save(flat, f["gds.pt"], format="torch")
    gds_persist.save(flat, f["gds.safetensors"], format="safetensors")
    torch.save(flat, f["torch.pt"])
    save_file(flat, f["stock.safetensors"])
    os.sync()
    live = {k: torch.empty_like(t).fill_(0) for k, t in flat.items()}
    del flat
    gc.collect()

    def tl(path: str) -> Callable[[], Any]:
        return lambda: torch.load(path, weights_only=True)

    methods: dict[str, tuple[tuple[str, Callable[[], Any], str], ...]] = {
        "dir": (("gds load(dir)", lambda: gds_persist.load(f["ck"]), f["ck"]),
                ("torch.load", tl(f["torch.pt"]), f["torch.pt"])),
        "pt": (("gds load(gds.pt)", lambda: gds_persist.load(f["gds.pt"]), f["gds.pt"]),
               ("torch.load(gds.pt)", tl(f["gds.pt"]), f["gds.pt"])),
        "into": (("gds load(dir, into=)", lambda: gds_persist.load(f["ck"], into=live), f["ck"]),
                 ("torch.load(mmap)+copy", lambda: copy_into(live, torch.load(
                     f["torch.pt"], weights_only=True, mmap=True)), f["torch.pt"])),
        "st": (("gds load(st, into=)", lambda: gds_persist.load(f["gds.safetensors"], into=live),
                f["gds.safetensors"]),
               ("load_file+copy", lambda: copy_into(live, load_file(f["stock.safetensors"])),
                f["stock.safetensors"])),
        "placebo": (("torch.load", tl(f["torch.pt"]), f["torch.pt"]),
                    ("torch.load again", tl(f["torch.pt"]), f["torch.pt"])),
    }

    def with_settings(fn: Callable[[], Any], **values: Any) -> Callable[[], Any]:
        def run() -> Any:
            with gds_persist.settings.set(**values):
                return fn()
        return run

    plain = lambda: gds_persist.load(f["ck"])  # noqa: E731
    into = lambda: gds_persist.load(f["ck"], into=live)  # noqa: E731
    methods.update({  # candidates: the engine against itself
        "threads2": (("gds load io_threads=4", plain, f["ck"]),
                     ("gds load io_threads=2", with_settings(plain, io_threads=2), f["ck"])),
        "direct": (("gds load auto", plain, f["ck"]),
                   ("gds load direct", with_settings(plain, backend="direct"), f["ck"])),
        "buffered": (("gds load auto", plain, f["ck"]),
                     ("gds load buffered", with_settings(plain, backend="buffered"), f["ck"])),
        "into-threads2": (("into io_threads=4", into, f["ck"]),
                          ("into io_threads=2", with_settings(into, io_threads=2), f["ck"])),
        "into-buffered": (("into auto", into, f["ck"]),
                          ("into buffered", with_settings(into, backend="buffered"), f["ck"])),
    })
    methods.update({  # the same comparisons of in-place loads, one file for both readers
        "into-pt": (("gds load(gds.pt, into=)", lambda: gds_persist.load(f["gds.pt"], into=live),
                     f["gds.pt"]),
                    ("torch.load(gds.pt, mmap)+copy", lambda: copy_into(live, torch.load(
                        f["gds.pt"], weights_only=True, mmap=True)), f["gds.pt"])),
        "st-same": (("gds load(st, into=)", lambda: gds_persist.load(f["gds.safetensors"],
                                                                     into=live),
                     f["gds.safetensors"]),
                    ("load_file(gds st)+copy", lambda: copy_into(live, load_file(os.path.join(
                        f["gds.safetensors"], "model.safetensors"))), f["gds.safetensors"])),
    })
    methods.update({  # the targets with backend="buffered" (what auto's rule might choose)
        "dir-buffered": (("gds load(dir) buffered", with_settings(plain, backend="buffered"),
                          f["ck"]), ("torch.load", tl(f["torch.pt"]), f["torch.pt"])),
        "into-buffered-mmap": (("into buffered", with_settings(into, backend="buffered"),
                                f["ck"]), methods["into"][1]),
    })
    methods.update({  # which file, not which reader: the host's placement of it
        "files": (("torch.load(torch.pt)", tl(f["torch.pt"]), f["torch.pt"]),
                  ("torch.load(gds.pt)", tl(f["gds.pt"]), f["gds.pt"])),
        "stock": (("gds load(torch.pt)", lambda: gds_persist.load(f["torch.pt"]), f["torch.pt"]),
                  ("torch.load(torch.pt)", tl(f["torch.pt"]), f["torch.pt"])),
    })
    wanted = a.only.split(",")

    def timed(fn: Callable[[], Any], path: str) -> float:
        if a.warm:
            warm([path])  # the files in the page cache (read through it once)
        else:
            evict([path])
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        del out
        gc.collect()
        return dt

    results: dict[str, list[dict[str, float]]] = {k: [] for k in wanted}
    for i in range(a.pairs):
        for k in wanted:
            (na, fa, pa), (nb, fb, pb) = methods[k]
            t = {}
            order = [("a", fa, pa), ("b", fb, pb), ("b", fb, pb), ("a", fa, pa)]
            if i % 2:
                order = order[1:3] + [order[0], order[3]]  # B A A B
            got: dict[str, list[float]] = {"a": [], "b": []}
            for which, fn, path in order:
                got[which].append(timed(fn, path))
            t = {"a": statistics.mean(got["a"]), "b": statistics.mean(got["b"])}
            results[k].append(t)
            print(f"pair {i} {k:8s} {na} {t['a']:.3f} s  {nb} {t['b']:.3f} s  "
                  f"ratio {t['b'] / t['a']:.2f}  load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{'warm' if a.warm else 'cold (fadvise DONTNEED)'} {a.dir} {a.size >> 20} MiB")
    for k in wanted:
        (na, _, _), (nb, _, _) = methods[k]
        ratios = [r["b"] / r["a"] for r in results[k]]
        print(f"{k:8s} {na} vs {nb}: median {statistics.median(ratios):.2f}x "
              f"(per pair {', '.join(f'{r:.2f}' for r in ratios)}; A median "
              f"{statistics.median(r['a'] for r in results[k]):.3f} s, B "
              f"{statistics.median(r['b'] for r in results[k]):.3f} s)")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"dir": a.dir, "warm": a.warm, "size": a.size, "results": results}, out)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
