"""Several processes, one checkpoint path (issue 11): savers and loaders at once, and a count of
everything that went wrong.

    python tests/contention.py                  # 3 savers x 6 saves, 2 loaders, 3 runs, all modes
    python tests/contention.py --mode plain --runs 5 --mib 8

``--savers`` processes each save ``--saves`` distinct states (every tensor of one state carries
the same tag) to one path while ``--loaders`` processes load (and verify, and read the manifest
of) that path in a loop until the savers are done. Modes:

* ``plain``: ``gds_persist.save(state, path)``;
* ``no-exchange``: the same, committing with the two-rename fallback (filesystems without
  ``RENAME_EXCHANGE``);
* ``data-dirs``: data-parallel saves (no process group) striping the data over two data
  directories, which later saves clean up;
* ``checkpointer``: one :class:`gds_persist.Checkpointer` (``keep_last=1``: its retention deletes
  the step loaders are loading) saves ``savers x saves`` steps; loaders load its latest step
  through their own Checkpointer on the root, as an evaluation job would.

Printed per run: failed saves, false corruption/truncation errors (a ChecksumError,
TruncatedError, NotCommittedError or ManifestError about a checkpoint that was healthy), other
errors, "replaced, retry" errors (CheckpointReplacedError: allowed, counted), mixed states (a
load returning tensors of two saves), leftover temporaries, and whether the final checkpoint
loads and verifies as one of the saves. The exit status is 1 if any count that must be 0 is not.
``tests/test_concurrency.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("plain", "no-exchange", "data-dirs", "checkpointer")
FALSE_ERRORS = ("ChecksumError", "TruncatedError", "NotCommittedError", "ManifestError")


def make_state(tag: int, numel: int) -> dict[str, Any]:
    import torch

    return {"tag": tag, "big": torch.full((numel,), float(tag)),
            "ints": [torch.full((n,), tag, dtype=torch.int64) for n in (1, 511, 4097)],
            "half": torch.full((numel // 3 + 1,), tag, dtype=torch.float16)}  # exact below 2048


def tags_of(sd: Any) -> set[float]:
    """Every tag a loaded state carries (one, unless it mixes two saves)."""
    tags = {float(sd["tag"])}
    for t in (sd["big"], sd["half"], *sd["ints"]):
        tags.update(float(v) for v in t.unique().tolist())
    return tags


def _data_dirs(work: str) -> list[str]:
    return [os.path.join(work, "nvme0"), os.path.join(work, "nvme1")]


def saver(index: int, args: dict[str, Any], results: Any, start: Any) -> None:
    import gds_persist
    from gds_persist.transfer import commit

    if args["mode"] == "no-exchange":
        commit.USE_RENAME_EXCHANGE = False
    numel = args["mib"] * (1 << 20) // 4
    failed, committed, errors = 0, [], []
    start.wait(timeout=300)
    t0 = time.perf_counter()
    ckpt = (gds_persist.Checkpointer(args["path"], keep_last=1)
            if args["mode"] == "checkpointer" else None)
    try:
        for k in range(args["saves"] * (args["savers"] if ckpt is not None else 1)):
            tag = index * 100 + k
            try:
                if ckpt is not None:
                    ckpt.save(k + 1, make_state(tag, numel), blocking=True)
                else:
                    options = gds_persist.SaveOptions(data_dirs=_data_dirs(args["work"])
                                                      if args["mode"] == "data-dirs" else None)
                    gds_persist.save(make_state(tag, numel), args["path"], options=options)
                committed.append(tag)
                time.sleep(args["gap_s"])  # lets loaders overlap more saves on few cores
            except Exception as e:  # noqa: BLE001 - counted and reported
                failed += 1
                errors.append(f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as e:  # noqa: BLE001
                errors.append(f"close: {type(e).__name__}: {str(e)[:300]}")
    results.put(("saver", index, {"failed": failed, "committed": committed, "errors": errors,
                                  "seconds": time.perf_counter() - t0}))


def loader(index: int, args: dict[str, Any], results: Any, start: Any, done: Any) -> None:
    import gds_persist

    counts: Counter[str] = Counter()
    samples: dict[str, str] = {}
    start.wait(timeout=300)
    ckpt = (gds_persist.Checkpointer(args["path"], keep_last=None)
            if args["mode"] == "checkpointer" else None)
    i = 0
    while not done.is_set() or i < 3:
        kind = ("load", "load", "verify", "manifest")[i % 4]
        i += 1
        try:
            if kind == "load":
                sd = ckpt.load() if ckpt is not None else gds_persist.load(args["path"])
                counts["loads"] += 1
                if len(tags_of(sd)) != 1:
                    counts["mixed"] += 1
                    samples.setdefault("mixed", str(sorted(tags_of(sd))))
            elif kind == "verify":
                path = args["path"]
                if ckpt is not None:
                    step = ckpt.latest_step()
                    if step is None:
                        continue
                    path = os.path.join(path, f"step-{step:08d}")
                report = gds_persist.verify(path)
                counts["verifies"] += 1
                if not report.ok:
                    counts["false:ChecksumError"] += 1
                    samples.setdefault("false:ChecksumError", str(report.errors[0]))
            else:
                if ckpt is None:
                    gds_persist.read_manifest(args["path"])
                    counts["manifests"] += 1
        except getattr(gds_persist, "CheckpointReplacedError", ()) as e:  # (older versions: none)
            counts["replaced"] += 1
            samples.setdefault("replaced", str(e))
        except Exception as e:  # noqa: BLE001 - counted and reported
            name = type(e).__name__
            key = f"false:{name}" if name in FALSE_ERRORS else f"other:{name}"
            if (ckpt is not None and name == "NotCommittedError" and kind == "verify"):
                key = "replaced"  # verify of a step path retention removed: not a false error
            counts[key] += 1
            samples.setdefault(key, "".join(traceback.format_exception_only(e)).strip()[:400])
    if ckpt is not None:
        ckpt.close()
    results.put(("loader", index, {"counts": dict(counts), "samples": samples}))


def leftovers(args: dict[str, Any]) -> list[str]:
    """What the runs left besides the checkpoint (and, for data-dirs, its data directories)."""
    import gds_persist

    work, name = args["work"], os.path.basename(args["path"])
    if args["mode"] == "checkpointer":
        root = args["path"]
        latest = gds_persist.Checkpointer(root, keep_last=None)
        try:
            keep = {"latest", f"step-{latest.latest_step():08d}"}
        finally:
            latest.close()
        return sorted(set(os.listdir(root)) - keep)
    left = sorted(set(os.listdir(work)) - {name, "nvme0", "nvme1"})
    if args["mode"] == "data-dirs":
        m = gds_persist.read_manifest(args["path"])
        used = {os.path.join(d.root, d.name) for d in m.dirs}
        for root in _data_dirs(work):
            left += [os.path.join(os.path.basename(root), e)
                     for e in (os.listdir(root) if os.path.isdir(root) else [])
                     if os.path.join(root, e) not in used]
    return left


def final_state(args: dict[str, Any]) -> tuple[int | None, str]:
    import gds_persist

    try:
        if args["mode"] == "checkpointer":
            ckpt = gds_persist.Checkpointer(args["path"], keep_last=None)
            try:
                sd = ckpt.load()
                path = os.path.join(args["path"], f"step-{ckpt.latest_step():08d}")
            finally:
                ckpt.close()
        else:
            sd, path = gds_persist.load(args["path"]), args["path"]
        if not gds_persist.verify(path).ok or len(tags_of(sd)) != 1:
            return None, "final checkpoint does not verify or is mixed"
        return int(sd["tag"]), ""
    except Exception as e:  # noqa: BLE001
        return None, f"final checkpoint: {type(e).__name__}: {e}"


def run_once(mode: str, savers: int, saves: int, loaders: int, mib: int,
             work: str, gap_s: float = 0.0) -> dict[str, Any]:
    """One run in the fresh directory ``work``; returns the counts (see the module docstring)."""
    import gds_persist

    path = os.path.join(work, "ckpt" if mode == "checkpointer" else "ck")
    args = {"mode": mode, "path": path, "work": work, "savers": savers, "saves": saves,
            "mib": mib, "gap_s": gap_s}
    numel = mib * (1 << 20) // 4
    if mode == "checkpointer":  # a first step, so loaders always find one
        with gds_persist.Checkpointer(path, keep_last=1) as ckpt:
            ckpt.save(0, make_state(-1, numel), blocking=True)
    else:
        options = gds_persist.SaveOptions(data_dirs=_data_dirs(work) if mode == "data-dirs"
                                          else None)
        gds_persist.save(make_state(-1, numel), path, options=options)
    if mode == "checkpointer":
        savers = 1  # one trainer; two on one root would prune each other's steps by design
    ctx = mp.get_context("spawn")
    # everyone imports first, then all start together (the barrier), so loads overlap saves
    results, start, done = ctx.Queue(), ctx.Barrier(savers + loaders), ctx.Event()
    procs = [ctx.Process(target=saver, args=(i, args, results, start)) for i in range(savers)]
    procs += [ctx.Process(target=loader, args=(i, args, results, start, done))
              for i in range(loaders)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    got: dict[tuple[str, int], dict[str, Any]] = {}
    deadline = time.monotonic() + 600
    while len([k for k in got if k[0] == "saver"]) < savers and time.monotonic() < deadline:
        try:
            kind, i, res = results.get(timeout=1)
            got[(kind, i)] = res
        except Exception:  # noqa: BLE001 - queue.Empty: check for dead processes
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    done.set()
    while len(got) < savers + loaders and time.monotonic() < deadline:
        try:
            kind, i, res = results.get(timeout=1)
            got[(kind, i)] = res
        except Exception:  # noqa: BLE001
            if all(p.exitcode is not None for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    seconds = time.perf_counter() - t0
    counts: Counter[str] = Counter()
    samples: dict[str, str] = {}
    committed: list[int] = []
    for (kind, _), res in got.items():
        if kind == "saver":
            counts["failed_saves"] += res["failed"]
            counts["saves"] += len(res["committed"]) + res["failed"]
            committed += res["committed"]
            counts["saving_ms"] = max(counts["saving_ms"], int(1000 * res["seconds"]))
            for err in res["errors"][:1]:
                samples.setdefault("failed_saves", err)
        else:
            counts.update(res["counts"])
            for k, v in res["samples"].items():
                samples.setdefault(k, v)
    counts["dead_processes"] = sum(1 for p in procs if p.exitcode != 0)
    counts["missing_reports"] = savers + loaders - len(got)
    final, why = final_state(args)
    if final is not None and final not in committed:
        why = f"final checkpoint has tag {final}, which no reported save committed"
    left = leftovers(args)
    return {"mode": mode, "counts": counts, "samples": samples, "final": final,
            "final_problem": why, "leftovers": left, "seconds": seconds}


def problems(result: dict[str, Any]) -> list[str]:
    """What must be 0 and is not."""
    c = result["counts"]
    out = [f"{k}={v}" for k, v in sorted(c.items())
           if v and (k.startswith(("false:", "other:")) or k in (
               "failed_saves", "mixed", "dead_processes", "missing_reports"))]
    if result["leftovers"]:
        out.append(f"leftovers={result['leftovers']}")
    if result["final_problem"]:
        out.append(result["final_problem"])
    return out


def summary(result: dict[str, Any]) -> str:
    c = result["counts"]
    false = sum(v for k, v in c.items() if k.startswith("false:"))
    other = sum(v for k, v in c.items() if k.startswith("other:"))
    return (f"{result['mode']:>12}: saves {c['saves']} failed {c['failed_saves']} | loads "
            f"{c['loads']} verifies {c['verifies']} manifests {c['manifests']} | false "
            f"corruption/truncation {false}, other errors {other}, replaced-retry "
            f"{c['replaced']}, mixed {c['mixed']} | leftover temporaries "
            f"{len(result['leftovers'])} | final tag {result['final']} "
            f"(saving {c['saving_ms'] / 1000:.1f} s of {result['seconds']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES + ("all",), default="all")
    p.add_argument("--savers", type=int, default=3)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--loaders", type=int, default=2)
    p.add_argument("--mib", type=int, default=4, help="size of each state (MiB)")
    p.add_argument("--gap-ms", type=int, default=100, help="each saver's pause between saves")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to work (default: a temporary directory)")
    a = p.parse_args(argv)
    modes = MODES if a.mode == "all" else (a.mode,)
    bad = 0
    for run in range(a.runs):
        for mode in modes:
            with tempfile.TemporaryDirectory(dir=a.dir, prefix="contention-") as work:
                result = run_once(mode, a.savers, a.saves, a.loaders, a.mib, work,
                                  a.gap_ms / 1000)
            print(f"run {run + 1} {summary(result)}", flush=True)
            for issue in problems(result):
                print(f"    PROBLEM {issue}")
            for k, v in result["samples"].items():
                print(f"    sample {k}: {v}")
            bad += bool(problems(result))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
