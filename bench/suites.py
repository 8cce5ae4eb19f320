"""What the trainers' own-test suites (``lightning_suite.py``, ``deepspeed_suite.py``) share: the
records their pytest plugin writes, one line per test, and the entry that runs the suite twice
(stock, then with gds_persist) or reports on the records of the last run."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Records = dict[str, dict[str, Any]]  # pytest node id -> {"nodeid", "outcome", "error", ...}


def read_records(path: Path) -> Records:
    """The records of one run (none if it never ran)."""
    if not path.exists():
        return {}
    return {r["nodeid"]: r for r in map(json.loads, path.read_text().splitlines())}


def run_or_report(args: argparse.Namespace, labels: tuple[str, str],
                  run_both: Callable[[], tuple[list[str], Records, Records]],
                  report: Callable[[Records, Records, list[str]], list[str]]) -> None:
    """Run both ways (or, with ``--report-only``, read the records ``labels`` of the last run
    in ``args.work``), print the report and write it to ``args.out`` if given."""
    saved_header = args.work / "header.txt"
    if args.report_only:
        header = saved_header.read_text().splitlines()
        stock, ours = (read_records(args.work / f"{label}.jsonl") for label in labels)
    else:
        header, stock, ours = run_both()
        saved_header.write_text("\n".join(header) + "\n")
    text = "\n".join(report(stock, ours, header)) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
