"""This session's two changes against the code without them, in one process, rotated per round.

    PYTHONPATH=. python bench/results/2026-12-04-cpu-issue44-d/phase_ab.py DIR ROUNDS [--warm]

Arms (the library as committed, with one change switched off by patching its module):

* ``phased``: the committed code: large host tensors at their memory's phase (format version 5),
  short requests first;
* ``aligned``: every extent at a block boundary (``address_phases`` returns zeros), short first;
* ``in-order``: phased, but a load's requests issued in file order (the reader's
  ``short_first`` is the identity; in the recorded runs the writer issued its requests short
  first too, and this arm put them in file order as well: that was dropped from the writer
  after them, as it changed nothing, save 0.464 s against 0.475 s);
* ``torch``: ``torch.save``, ``torch.load``, ``torch.load(mmap=True)`` + copy.

Per round, in a rotated order: each arm saves its own checkpoint of a 1 GiB GPT-like state
(wall and process CPU seconds, fsync included), then loads it three ways, its files evicted
first (posix_fadvise DONTNEED) unless ``--warm``: plain; ``into=`` the very tensors it was saved
from (a rollback in place); ``into=`` fresh tensors allocated after other frees (about half at
another phase within a page). Prints every time and, per measure, the median over rounds of
each arm's time divided by ``torch``'s of the same round.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import gds_persist
from bench.state import iter_tensors, make_state_dict
from gds_persist.saving import directory
from gds_persist.transfer import reader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "2026-12-04-cpu-issue44-loads"))
from paired_loads import copy_into, evict  # noqa: E402  (the same eviction as the paired loads)

ARMS = ("phased", "aligned", "in-order", "torch")
MEASURES = ("save", "save cpu", "load", "into same", "into fresh")


def fresh_state() -> dict[str, torch.Tensor]:
    sd = make_state_dict(1 << 30)
    flat = {k: t.contiguous().clone() for k, t in iter_tensors(sd) if k != "model.lm_head.weight"}
    del sd
    gc.collect()
    return flat


def patched(arm: str) -> None:
    """Switch this arm's change off (and the others' back on)."""
    phases = directory.__dict__.setdefault("_committed_phases", directory.address_phases)
    first = reader.__dict__.setdefault("_committed_short_first", reader.short_first)
    directory.address_phases = ((lambda storages: [0] * len(storages)) if arm == "aligned"
                                else phases)
    order = (lambda requests, segment: list(requests)) if arm == "in-order" else first
    reader.short_first = order  # type: ignore[assignment]


def timed(fn: Callable[[], Any], paths: list[str], warm: bool) -> float:
    if not warm:
        evict(paths)
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def round_of(arm: str, work: str, flat: dict[str, torch.Tensor],
             fresh: dict[str, torch.Tensor], warm: bool) -> dict[str, float]:
    patched(arm)
    path = os.path.join(work, arm + (".pt" if arm == "torch" else ""))
    shutil.rmtree(path, ignore_errors=True)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if arm == "torch":
        with open(path, "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        gds_persist.save(flat, path)
    out = {"save": time.perf_counter() - t0, "save cpu": time.process_time() - cpu0}
    if arm == "torch":
        out["load"] = timed(lambda: torch.load(path, weights_only=True), [path], warm)
        for name, dest in (("into same", flat), ("into fresh", fresh)):
            out[name] = timed(lambda d=dest: copy_into(d, torch.load(
                path, weights_only=True, mmap=True)), [path], warm)
    else:
        out["load"] = timed(lambda: gds_persist.load(path), [path], warm)
        for name, dest in (("into same", flat), ("into fresh", fresh)):
            out[name] = timed(lambda d=dest: gds_persist.load(path, into=d), [path], warm)
    return out


def main() -> None:
    work, rounds, warm = sys.argv[1], int(sys.argv[2]), "--warm" in sys.argv
    os.makedirs(work, exist_ok=True)
    flat = fresh_state()
    fresh = {k: torch.empty_like(t).fill_(0) for k, t in flat.items()}
    large = [k for k, t in flat.items() if t.nbytes >= 1 << 20]
    same = sum(flat[k].data_ptr() % 4096 == fresh[k].data_ptr() % 4096 for k in large)
    print(f"{work}: {'warm' if warm else 'cold'}; {len(large)} large tensors, {same} of them "
          f"fresh at the saved phase")
    got: dict[str, dict[str, list[float]]] = {a: {m: [] for m in MEASURES} for a in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
        for arm in order:
            for m, v in round_of(arm, work, flat, fresh, warm).items():
                got[arm][m].append(v)
        print(f"round {r} ({' '.join(order)}): " + "; ".join(
            f"{a} " + " ".join(f"{got[a][m][-1]:.3f}" for m in MEASURES) for a in ARMS),
              flush=True)
    print("columns: " + ", ".join(MEASURES) + " (seconds)")
    for a in ARMS[:-1]:
        ratios = {m: statistics.median(t / b for t, b in zip(got[a][m], got["torch"][m],
                                                              strict=True)) for m in MEASURES}
        print(f"{a:9s} time / torch's, median of rounds: " + ", ".join(
            f"{m} {v:.2f}" for m, v in ratios.items()))
    for a in ARMS:
        print(f"{a:9s} median s: " + ", ".join(
            f"{m} {statistics.median(got[a][m]):.3f}" for m in MEASURES))


if __name__ == "__main__":
    main()
