"""How often ``backend="auto"``'s read-mode choice is right (issue 18).

    python bench/read_mode_predictor.py [--size 2GiB] [--runs 5] [--dir DIR ...] [--json OUT]

For each directory (default: bench/out on the disk and /dev/shm/bench): one checkpoint of a
GPT-like state (bench/state.py) is saved, then ``--runs`` times, in an order rotated every run,
three cold plain loads of it: ``backend="auto"`` after the measured choice was forgotten (so it
measures again, as the first load on a filesystem does; the on-disk history is not used
either), ``backend="direct"`` (O_DIRECT) and ``backend="buffered"`` (page cache). A choice is
**right** when the mode it took loaded the whole checkpoint no slower than the other in the
same run (a **tie** when the two are within ``--tie``); the auto load's own time includes its
sampling. The page cache is dropped before
every load (drop_caches as root, else posix_fadvise; tmpfs pages cannot be dropped).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gds_persist  # noqa: E402
from bench import machine, report  # noqa: E402
from bench.bench_io import new_parser, work_directory  # noqa: E402
from bench.state import make_state_dict  # noqa: E402
from gds_persist.backends import read_history, read_mode  # noqa: E402

MODES = ("auto", "direct", "buffered")
DEFAULT_DIRS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), "/dev/shm/bench")


def timed_load(path: str, backend: str) -> tuple[float, Any]:
    """Seconds of one cold plain load with ``backend`` and its LoadInfo."""
    if backend == "auto":  # measure again, as the first load on a filesystem does
        os.environ[read_history.CACHE_ENV] = ""  # nor the history earlier processes kept
        read_mode.forget()
    machine.drop_page_cache([path])
    t0 = time.perf_counter()
    state, info = gds_persist.load_with_info(path, backend=backend)
    seconds = time.perf_counter() - t0
    del state
    gc.collect()
    return seconds, info


def judge(chosen: str, seconds: dict[str, float], tie: float) -> str:
    """``right``, ``tie`` or ``wrong``: the chosen mode's full load against the other's."""
    other = "buffered" if chosen == "direct" else "direct"
    ratio = seconds[chosen] / seconds[other]
    if abs(ratio - 1) <= tie:
        return "tie"
    return "right" if ratio < 1 else "wrong"


def measure_dir(directory: str, args: argparse.Namespace) -> dict[str, Any]:
    with work_directory(directory, "predictor-") as workdir:
        path = os.path.join(workdir, "ck")
        gds_persist.save(make_state_dict(args.size, seed=0), path)
        gc.collect()
        runs = [one_run(path, r, args.tie) for r in range(args.runs)]
    return {"directory": directory, "fstype": machine.mount_of(directory)["fstype"],
            "payload_bytes": runs[-1]["payload_bytes"], "runs": runs}


def one_run(path: str, r: int, tie: float) -> dict[str, Any]:
    """The three cold loads of run ``r`` (order rotated) and the verdict on auto's choice."""
    order = list(MODES[r % 3:] + MODES[: r % 3])
    seconds, infos = {}, {}
    for mode in order:
        seconds[mode], infos[mode] = timed_load(path, mode)
    chosen = infos["auto"].backend
    run = {"order": order, "seconds": seconds, "chosen": chosen, "reason": infos["auto"].reason,
           "verdict": judge(chosen, seconds, tie), "payload_bytes": infos["auto"].payload_bytes}
    print(f"  {path} run {r + 1}: chose {chosen}; " + ", ".join(
        f"{m} {s:.2f}s" for m, s in seconds.items()) + f" -> {run['verdict']}",
        file=sys.stderr, flush=True)
    return run


def report_lines(result: dict[str, Any], tie: float) -> list[str]:
    runs = result["runs"]
    lines = [f"{result['directory']} ({result['fstype']}), "
             f"{result['payload_bytes'] / 2**30:.2f} GiB, {len(runs)} runs"
             + (" (tmpfs: its pages are the file, no cache to drop)"
                if result["fstype"] == "tmpfs" else "") + ":",
             f"  {'run':>3}  {'auto chose':<10}  {'auto s':>7}  {'direct s':>8}  "
             f"{'buffered s':>10}  {'faster':<8}  verdict"]
    for k, r in enumerate(runs, 1):
        s = r["seconds"]
        faster = "direct" if s["direct"] < s["buffered"] else "buffered"
        lines.append(f"  {k:>3}  {r['chosen']:<10}  {s['auto']:>7.2f}  {s['direct']:>8.2f}  "
                     f"{s['buffered']:>10.2f}  {faster:<8}  {r['verdict']}")
    counts = {v: sum(r["verdict"] == v for r in runs) for v in ("right", "tie", "wrong")}
    ratio = report.paired_ratio([r["seconds"]["auto"] for r in runs],
                                [min(r["seconds"]["direct"], r["seconds"]["buffered"])
                                 for r in runs])
    lines.append(f"  right {counts['right']}, tie (within {tie:.0%}) {counts['tie']}, wrong "
                 f"{counts['wrong']} of {len(runs)}; auto load time / the faster mode's, median "
                 f"{ratio:.2f}")
    lines += [f"  run {k} reason: {r['reason']}" for k, r in enumerate(runs, 1)]
    return lines


def build_parser(prog: str = "read_mode_predictor.py", doc: str | None = __doc__,
                 runs: int = 5) -> argparse.ArgumentParser:
    """The options of this script and of bench/read_mode_placebo.py."""
    p = new_parser(prog, doc, "checkpoint size")
    p.add_argument("--runs", type=int, default=runs, help=f"runs per directory (default {runs})")
    p.add_argument("--dir", dest="dirs", action="append", default=None,
                   help="a directory to measure in (repeatable; default bench/out and "
                        "/dev/shm/bench)")
    p.add_argument("--json", dest="json_out", default=None, help="write every timing here")
    return p


def run_dirs(args: argparse.Namespace, name: str,
             measure: Callable[[str, argparse.Namespace], dict[str, Any]],
             lines: Callable[[dict[str, Any]], list[str]]) -> dict[str, Any]:
    """``measure`` every directory of ``args`` with cold loads; print ``lines`` of each result
    under a header naming the machine; the record (also to ``--json``)."""
    cache = machine.drop_page_cache([], "auto")
    record: dict[str, Any] = {
        "schema": f"gds_persist-{name.replace(' ', '-')}/1", "argv": sys.argv,
        "machine": machine.describe(os.path.dirname(os.path.abspath(__file__))),
        "cache": cache[1], "results": [measure(d, args) for d in args.dirs or DEFAULT_DIRS]}
    print(f"{name}: {record['machine']['cpu']}, "
          f"{record['machine']['cores']['usable']} cores; cold loads: {cache[1]}; "
          f"gds_persist git {record['machine']['versions'].get('gds_persist_git')}")
    for result in record["results"]:
        print("\n".join(lines(result)))
    if args.json_out:
        report.to_json(record, args.json_out)
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    p.add_argument("--tie", type=float, default=0.05,
                   help="relative difference under which both modes count as equal (0.05)")
    args = p.parse_args(argv)
    return run_dirs(args, "read-mode predictor", measure_dir,
                    lambda result: report_lines(result, args.tie))


if __name__ == "__main__":
    main()
