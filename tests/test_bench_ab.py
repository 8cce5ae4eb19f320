"""bench/ab_revisions.py as its command line runs it: two trees (here the same one) measured in
turns, every run's JSON kept, the after / before ratios summarized. Among the slowest tests
(about 11 s): it starts bench_io.py twice as fresh interpreters, each tree's own script, which is
what the A/B comparison is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ab_revisions_runs_both_trees_in_turns_and_summarizes(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    proc = subprocess.run(
        [sys.executable, "bench/ab_revisions.py", "--before", str(REPO), "--after", str(REPO),
         "--pairs", "1", "--dirs", str(tmp_path), "--size", "8MiB", "--runs", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted(p.name for p in out.glob("*.json"))
    where = tmp_path.name
    assert runs == [f"{where}-after-0.json", f"{where}-before-0.json"], runs
    summary = (out / "summary.txt").read_text()
    for op, key in (("save", "gds-auto"), ("load", "gds-auto"), ("save", "torch")):
        line = next(x for x in summary.splitlines() if x.split()[:2] == [op, key])
        assert float(line.split()[3]) > 0, line
