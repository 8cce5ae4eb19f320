"""Medians of fresh_ab.sh's output: per tree, each arm's median over all rounds, and the plain
loads' ratio to torch.load per round (torch.load's time over the load's: > 1 is faster).

    python bench/results/2026-12-05-cpu-issue44-h/summarize.py OUTPUT.txt
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    by_tree: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    tree = ""
    for line in open(path):
        if line.startswith("== process"):
            tree = "before" if line.split()[-1] != "." else "after"
        elif line.startswith("{"):
            times = json.loads(line)
            arms = by_tree.setdefault(tree, {})
            for arm, ts in times.items():
                arms.setdefault(arm, []).extend(ts)
            for arm in ("load(dir)", "load(pt)"):
                ratios.setdefault(tree, {}).setdefault(arm, []).extend(
                    t / s for s, t in zip(times[arm], times["torch.load"], strict=True))
    for tree, arms in by_tree.items():
        med = {a: round(statistics.median(ts), 3) for a, ts in arms.items()}
        print(f"{tree}: median s {med}")
        for arm, rs in ratios[tree].items():
            print(f"  {arm} x torch.load: median {statistics.median(rs):.2f}, "
                  f"faster in {sum(r > 1 for r in rs)} of {len(rs)} rounds, "
                  f"worst {min(rs):.2f}")
    for arm in ("load(dir)", "load(pt)"):
        b, a = (statistics.median(by_tree[t][arm]) for t in ("before", "after"))
        print(f"{arm}: after / before time {a / b:.3f} ({b:.3f} -> {a:.3f} s)")


if __name__ == "__main__":
    main(sys.argv[1])
