"""Loads paired with torch's, round by round, beside placebos and the read bound (issue 44).

    python bench/bench_loads.py [--size 1GiB] [--processes 3] [--rounds 4] [--dir DIR]
                                [--backend B] [--json OUT]

A GPT-like state (bench/state.py) is saved once in the directory format (``dir``) and once as a
torch.save container (``pt``: ``save(format="torch")``, which torch.load reads too), and one
restore of each is checked tensor by tensor. Then ``--processes`` fresh processes, one after
another, run ``--rounds`` rounds each (after one untimed round); every round runs each arm once,
in a shuffled order, each after its file's page cache is dropped (``posix_fadvise(DONTNEED)``
per file; tmpfs pages cannot be dropped) and ``--settle`` seconds have passed (default 3):

* on ``dir``: ``bound``, ``load``, ``into``, and each again (``bound'``, ``load'``, ``into'``);
* on ``pt``: ``bound``, ``load``, ``into``, ``torch.load``, ``mmap+copy``, ``torch.load'``.

``load`` is ``gds_persist.load(path)``; ``into`` restores into live tensors
(``load(path, into=live)``); ``mmap+copy`` is ``torch.load(mmap=True)`` and a copy into the same
live tensors; ``bound`` is the **aligned reader**: the file's bytes read with O_DIRECT in
``block_bytes`` requests by ``io_threads`` threads into reused page-aligned memory, no copy and
no checksum: the read with nothing else in it (a reference, not a ceiling: below).

Why the order is shuffled, the pause, and six reads of each file a round: on the development VM
(Firecracker) the guest reports free memory to the host (virtio-balloon free page reporting,
about 2 s after it is freed), which takes it back, so a load into fresh memory pays the host's
page faults: one 1 GiB torch.load, four in a row, took 0.95, 0.55, 1.54 and 0.78 s, and with
a 3 s pause before each 1.89, 2.21, 1.96 and 0.82 s. Arms in a rotated order always follow the
same arm: the placebo ``torch.load'``, always after ``mmap+copy`` (which frees 1 GiB of page
cache), read 2.4x faster than ``torch.load`` (median of 10 rounds). Shuffled and paused,
every arm starts alike. Cold reads may come from the host's cache, which favours a file read
more often: each file is read as often as the other, and the ``bound`` placebo shows what is
left. And O_DIRECT's rate there depends on which memory a buffer landed in, for the buffer's
life: six sets of four 16 MiB buffers allocated alike in one process read a 1 GiB file at 1.45
to 2.42 GB/s, each set within 0.1 of its own median over four rounds. A process's staging
ring, its aligned reader and its tensors are one such draw, so one process's rounds can all
lean one way (a load can beat the aligned reader of its own process); hence several processes,
each one's medians printed.

Printed per round and summarized (median, range, rounds where ours was faster), as torch's time
/ ours (> 1: ours faster): ``load`` and ``into`` of each file against ``torch.load`` and
``mmap+copy`` of ``pt``. **Placebos**, the same work twice, say what one paired run resolves:
``torch.load'`` against ``torch.load`` (one file), ``load'``/``into'`` against ``load``/``into``
(dir), and ``bound`` of ``dir`` against ``bound`` of ``pt`` (one reader, two files: what the
file alone does to a comparison across formats). Where a comparison's worst round lies within
its placebo's spread, the machine, not the load, decides that round. Each arm is also given
as its file's ``bound``'s time over its own in the same round.
"""

from __future__ import annotations

import gc
import json
import mmap
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gds_persist  # noqa: E402
from bench import machine  # noqa: E402
from bench.bench_io import new_parser, work_directory  # noqa: E402
from bench.state import iter_tensors, make_state_dict  # noqa: E402
from gds_persist.backends import supports_o_direct  # noqa: E402
from gds_persist.backends.posix import pread_all  # noqa: E402

PAGE = 4096
SETTLE_S = 3.0  # > the 2 s after which Linux reports free guest pages to the host
DIR_ARMS = ("bound", "load", "into", "bound'", "load'", "into'")
PT_ARMS = ("bound", "load", "into", "torch.load", "mmap+copy", "torch.load'")
# (name, ours, theirs): each round's theirs / ours
COMPARISONS = (
    ("load(dir) x torch.load", "dir load", "pt torch.load"),
    ("into(dir) x mmap+copy", "dir into", "pt mmap+copy"),
    ("load(pt) x torch.load", "pt load", "pt torch.load"),
    ("into(pt) x mmap+copy", "pt into", "pt mmap+copy"),
)
PLACEBOS = (
    ("torch.load' x torch.load (pt)", "pt torch.load'", "pt torch.load"),
    ("load' x load (dir)", "dir load'", "dir load"),
    ("into' x into (dir)", "dir into'", "dir into"),
    ("bound(dir) x bound(pt)", "dir bound", "pt bound"),
)


class AlignedReader:
    """Reads whole files with O_DIRECT (buffered where the filesystem refuses it) in ``block``
    requests on ``threads`` threads, each into its own page-aligned buffer, allocated and
    touched once: the read with nothing else in it."""

    def __init__(self, threads: int, block: int, o_direct: bool):
        self.threads, self.block = threads, block
        self.flags = os.O_DIRECT if o_direct and hasattr(os, "O_DIRECT") else 0
        self._buffers = [mmap.mmap(-1, block) for _ in range(threads)]
        for b in self._buffers:
            b.write(b"\1" * block)  # touched: no page faults inside the timing
        self._free = list(self._buffers)
        self._lock = threading.Lock()

    def read(self, files: list[str]) -> int:
        """Read every byte of ``files``; returns the bytes read. Each thread reads a contiguous
        stream (a file, or a part of one where there are fewer files than threads), in order,
        as the engine's I/O threads each keep to a data file."""
        streams = self.streams(files)
        with ThreadPoolExecutor(self.threads) as pool:
            return sum(pool.map(lambda st: self._stream(*st), streams))

    def streams(self, files: list[str]) -> list[tuple[str, int, int]]:
        """``(path, lo, hi)`` byte ranges: every file cut into ``threads // len(files)`` parts
        (at least one) of whole requests."""
        parts = max(1, self.threads // max(1, len(files)))
        out = []
        for f in files:
            size = os.path.getsize(f)
            per = max(1, -(-size // parts // self.block)) * self.block
            out += [(f, lo, min(lo + per, size)) for lo in range(0, size, per)]
        return out

    def _stream(self, path: str, lo: int, hi: int) -> int:
        with self._lock:
            buf = self._free.pop()
        fd = os.open(path, os.O_RDONLY | self.flags)
        total = 0
        try:
            with memoryview(buf) as view:
                for at in range(lo, hi, self.block):
                    total += pread_all(fd, view[: -(-min(self.block, hi - at) // PAGE) * PAGE],
                                       at)
            return total
        finally:
            os.close(fd)
            with self._lock:
                self._free.append(buf)

    def close(self) -> None:
        for b in self._buffers:
            b.close()


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)


def copy_into(live: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(got[k])


def arms_for(paths: dict[str, str], live: dict[str, torch.Tensor], reader: AlignedReader,
             backend: str | None = None) -> dict[str, Callable[[], Any]]:
    """Every arm of a round, by ``"<file> <arm>"``; ours load with ``backend`` (None: the
    default)."""
    def ours(path: str, into: bool) -> Callable[[], Any]:
        return lambda: gds_persist.load(path, into=live if into else None, backend=backend)

    def bound(path: str) -> Callable[[], Any]:
        return lambda: reader.read(files_under(path))

    pt = paths["pt"]
    theirs: dict[str, Callable[[], Any]] = {
        "torch.load": lambda: torch.load(pt, weights_only=True),
        "mmap+copy": lambda: copy_into(live, torch.load(pt, weights_only=True, mmap=True)),
    }

    def arm(file: str, name: str) -> Callable[[], Any]:
        base = name.rstrip("'")  # a primed arm repeats its unprimed one: the placebo
        if base == "bound":
            return bound(paths[file])
        if base in ("load", "into"):
            return ours(paths[file], base == "into")
        return theirs[base]

    return {f"{file} {name}": arm(file, name)
            for file, names in (("dir", DIR_ARMS), ("pt", PT_ARMS)) for name in names}


def ratios(times: dict[str, list[float]], ours: str, theirs: str) -> list[float]:
    return [t / o for o, t in zip(times[ours], times[theirs], strict=True)]


def summary(name: str, values: list[float]) -> dict[str, Any]:
    return {"name": name, "per_round": values, "median": statistics.median(values),
            "min": min(values), "max": max(values), "faster": sum(v > 1 for v in values)}


def check_restores(paths: dict[str, str], live: dict[str, torch.Tensor],
                   state: dict[str, torch.Tensor], backend: str | None = None) -> None:
    """Restore each file into zeroed live tensors once and compare every tensor with the saved
    one (outside the timing): the arms time loads that are right."""
    for file, path in paths.items():
        for t in live.values():
            t.zero_()
        gds_persist.load(path, into=live, backend=backend)
        wrong = [k for k, t in live.items() if not torch.equal(t, state[k])]
        if wrong:
            raise SystemExit(f"{file}: restored tensors differ from the saved ones: {wrong[:5]}")


def run_rounds(arms: dict[str, Callable[[], Any]], paths: dict[str, str], rounds: int,
               cache_mode: str, settle_s: float, process: int = 0
               ) -> tuple[dict[str, list[float]], str]:
    """Every arm once a round, in a shuffled order (seeded by the process and the round: no arm
    always follows the same one), each after its file's cache is dropped and ``settle_s`` has
    passed."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    cache = ""
    for r in range(-1, rounds):  # round -1 warms every path up and is not kept
        order = list(names)
        if r >= 0:
            random.Random(process * 1000 + r).shuffle(order)
        for n in order:
            gc.collect()  # the arm before's memory freed before the drop and the pause
            cache = machine.drop_page_cache([paths[n.split()[0]]], cache_mode)[1]
            time.sleep(settle_s)
            t0 = time.perf_counter()
            arms[n]()
            seconds = time.perf_counter() - t0
            if r >= 0:
                times[n].append(seconds)
        if r >= 0:
            print(f"process {process} round {r}: " + "  ".join(
                f"{n} {times[n][-1]:.3f}" for n in names), flush=True)
    return times, cache


def report(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """The summaries, printed: comparisons, placebos, and each arm against its file's bound."""
    out: dict[str, Any] = {"comparisons": [], "placebos": [], "arms": {}}
    for key, rows in (("comparisons", COMPARISONS), ("placebos", PLACEBOS)):
        print(f"{key} (their time / ours per round; > 1: ours faster):")
        for name, ours, theirs in rows:
            s = summary(name, ratios(times, ours, theirs))
            out[key].append(s)
            print(f"  {name:32s} median {s['median']:.2f}, range {s['min']:.2f}-{s['max']:.2f}, "
                  f"faster in {s['faster']} of {len(s['per_round'])}")
    print("each arm: median s, GB/s, and its file's bound's time / its time per round (median):")
    for n, secs in times.items():
        file = n.split()[0]
        near = statistics.median(ratios(times, n, f"{file} bound"))
        out["arms"][n] = {"seconds": secs, "median_s": statistics.median(secs),
                          "of_bound": near}
        print(f"  {n:16s} {statistics.median(secs):.3f} s  "
              f"{nbytes / statistics.median(secs) / 1e9:5.2f} GB/s  x bound {near:.2f}")
    return out


def flat_state(size: int) -> dict[str, torch.Tensor]:
    """bench/state.py's GPT-like state of ``size`` bytes as flat keys, the tied LM head left out
    (live tensors are separate storages, one per key)."""
    return {k: t.contiguous().clone() for k, t in iter_tensors(make_state_dict(size, seed=0))
            if k != "model.lm_head.weight"}


def save_both(state: dict[str, torch.Tensor], workdir: str) -> dict[str, str]:
    """``state`` saved as a directory (``dir``) and a torch.save container (``pt``)."""
    paths = {"dir": os.path.join(workdir, "ck"), "pt": os.path.join(workdir, "gds.pt")}
    gds_persist.save(state, paths["dir"])
    gds_persist.save(state, paths["pt"], format="torch")
    return paths


def measure(paths: dict[str, str], rounds: int, cache_mode: str, settle_s: float,
            backend: str | None, process: int) -> tuple[dict[str, list[float]], str]:
    """The rounds of one process (run in a fresh one: its buffers and tensors are a draw of its
    own, see the module docstring): live tensors shaped as the saved ones, touched."""
    live = {k: torch.zeros_like(t)
            for k, t in torch.load(paths["pt"], weights_only=True, mmap=True).items()}
    settings = gds_persist.settings.current()
    reader = AlignedReader(settings.io_threads, settings.block_bytes,
                           supports_o_direct(os.path.dirname(paths["pt"]))[0])
    try:
        return run_rounds(arms_for(paths, live, reader, backend), paths, rounds, cache_mode,
                          settle_s, process)
    finally:
        reader.close()


def in_processes(paths: dict[str, str], args: Any) -> tuple[dict[str, list[float]], str]:
    """:func:`measure` in ``args.processes`` fresh processes, one after another; every arm's
    times in process order."""
    times: dict[str, list[float]] = {}
    cache = ""
    spawn = multiprocessing.get_context("spawn")
    for k in range(args.processes):
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            got, cache = pool.submit(measure, paths, args.rounds, args.cache_drop, args.settle,
                                     args.backend, k).result()
        for n, secs in got.items():
            times.setdefault(n, []).extend(secs)
        print(f"process {k}: " + ", ".join(
            f"{name} {statistics.median(ratios(got, ours, theirs)):.2f}"
            for name, ours, theirs in COMPARISONS), flush=True)
    return times, cache


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = new_parser("bench_loads.py", __doc__, "state dict size")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds a process (default 4)")
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes, one after another (default 3)")
    p.add_argument("--dir", default=None, help="directory to test (default bench/out)")
    p.add_argument("--cache-drop", default="per-file", choices=machine.CACHE_MODES,
                   help="how the cache is dropped before each arm (default per-file)")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help=f"seconds to wait before each arm (default {SETTLE_S}; see the module "
                        "docstring)")
    p.add_argument("--backend", default=None,
                   help="gds_persist's read backend (default: the library's, auto)")
    p.add_argument("--json", default=None, help="write every time and summary here")
    args = p.parse_args(argv)
    state = flat_state(args.size)
    nbytes = sum(t.nbytes for t in state.values())
    settings = gds_persist.settings.current()
    with work_directory(args.dir, "loads-") as workdir:
        paths = save_both(state, workdir)
        check_restores(paths, {k: torch.zeros_like(t) for k, t in state.items()}, state,
                       args.backend)
        del state
        times, cache = in_processes(paths, args)
        print(f"{nbytes / 2**30:.2f} GiB, {args.processes} processes x {args.rounds} rounds, "
              f"backend {args.backend or settings.backend}, cache: {cache}")
        record = {"schema": "gds_persist-bench-loads/1", "machine": machine.describe(workdir),
                  "config": {"bytes": nbytes, "rounds": args.rounds,
                             "processes": args.processes, "cache": cache,
                             "backend": args.backend or settings.backend,
                             "settle_s": args.settle,
                             "io_threads": settings.io_threads,
                             "block_bytes": settings.block_bytes},
                  "times": times, **report(times, nbytes)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    main()
