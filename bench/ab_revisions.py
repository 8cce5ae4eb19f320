"""Two revisions of gds_persist side by side: ``bench/bench_io.py`` of each tree (its own package,
its own script) run in turns, before then after, on each directory, ``--pairs`` times; then the
after / before ratio of every method's median, pair by pair, and the median of those ratios.

    python bench/ab_revisions.py --before /work/wt-before --after . --pairs 3 \\
        --dirs bench/out,/dev/shm --out bench/results/DATE-cpu-ab-REV

Every write figure includes fsync (bench_io.py's). A ratio near 1.00 with its spread across the
pairs is what "unchanged within noise" means here; the runs alternate, before first in even pairs
and after first in odd ones (ABBA), so that neither a drifting machine nor the run order (the
second run of a pair meets the first one's freed files and dirty cache) favours a revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import machine

METHODS = "gds-auto,gds-torch,torch"


def run_once(tree: str, directory: str, size: str, runs: int, json_path: str) -> None:
    cmd = [sys.executable, "bench/bench_io.py", "--size", size, "--runs", str(runs),
           "--methods", METHODS, "--dir", directory, "--dcp-threads", "1", "--json", json_path]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    with open(json_path[:-5] + ".txt", "w") as log:
        subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def medians(json_path: str) -> dict[tuple[str, str], float]:
    """(op, method) -> median GB/s of one bench_io.py run."""
    with open(json_path) as f:
        record = json.load(f)
    return {(s["op"], s["key"]): statistics.median(s["gbps"]) for s in record["series"]}


def ratios(pairs: list[tuple[str, str]], per_torch: bool = False
           ) -> dict[tuple[str, str], list[float]]:
    """(op, method) -> after / before, pair by pair; ``per_torch``: of each method's figure over
    torch.save's (torch.load's) in the same run, which the machine's drift between runs moves
    alike."""
    out: dict[tuple[str, str], list[float]] = {}
    for before, after in pairs:
        b, a = medians(before), medians(after)
        for op, key in sorted(set(a) & set(b)):
            unit = (a[(op, "torch")] / b[(op, "torch")]) if per_torch else 1.0
            out.setdefault((op, key), []).append(a[(op, key)] / b[(op, key)] / unit)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the tree of the earlier revision")
    p.add_argument("--after", default=".", help="the tree of the later revision")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--dirs", default="bench/out,/dev/shm")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--runs", type=int, default=3, help="bench_io.py --runs")
    p.add_argument("--out", required=True, help="folder for every run's JSON and log")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    trees = {"before": args.before, "after": args.after}
    revs = {k: machine.git_revision(t) for k, t in trees.items()}
    lines = [f"after {revs['after']} / before {revs['before']}: bench_io.py --size {args.size} "
             f"--runs {args.runs}, {args.pairs} pairs in ABBA order; ratio of medians (GB/s)"]
    for directory in args.dirs.split(","):
        where = os.path.basename(directory.rstrip("/")) or directory
        pairs = []
        for i in range(args.pairs):
            paths = {}
            # ABBA: before first in even pairs, after first in odd ones (the second run of a
            # pair meets the first one's freed files and dirty cache)
            order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                paths[name] = os.path.join(args.out, f"{where}-{name}-{i}.json")
                run_once(tree, os.path.abspath(directory), args.size, args.runs, paths[name])
            pairs.append((paths["before"], paths["after"]))
        lines.append(f"{directory} ({machine.mount_of(directory).get('fstype', '?')}): "
                     "after / before, and the same over torch's figure in its run")
        relative = ratios(pairs, per_torch=True)
        for (op, key), values in ratios(pairs).items():
            if key.startswith("drive") or key == "limit":  # the references
                continue
            shown = " ".join(f"{v:.2f}" for v in values)
            line = f"  {op:4} {key:10} median {statistics.median(values):.2f}  ({shown})"
            if key != "torch":
                rel = relative[(op, key)]
                line += (f"   x torch: median {statistics.median(rel):.2f}  "
                         f"({' '.join(f'{v:.2f}' for v in rel)})")
            lines.append(line)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
