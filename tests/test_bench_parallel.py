"""Smoke test of the data-parallel benchmark (bench/bench_parallel.py) at a tiny size.

Spawns two real gloo ranks once; every row the benchmark prints must be there, with positive
figures, and the exchanging load strategies must read the replicated bytes once in total.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_parallel

pytestmark = pytest.mark.slow


def test_parallel_benchmark_runs_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "parallel.json"
    assert bench_parallel.main(["--size", "2MiB", "--ranks", "1,2", "--runs", "1",
                                "--dir", str(tmp_path), "--json", str(out),
                                "--timeout", "300"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = {(r["method"], r["ranks"]) for r in data["rows"]}
    assert {("save", 1), ("save", 2), ("load allgather", 2), ("load broadcast", 2),
            ("load read_all", 2), ("load 1 proc (2-rank save)", 1)} <= rows
    for r in data["rows"]:
        assert r["gbps"] > 0 and r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
        assert r["of_drive"] > 0
    saves = [r for r in data["rows"] if r["method"] == "save"]
    assert all(r["rank_gbps"] and r["balance"] <= 1.5 for r in saves)
    reads = {r["method"]: r["read_bytes_total"] for r in data["rows"] if r.get("read_bytes_total")}
    if reads:  # /proc/self/io is Linux-only
        assert reads["load allgather"] < 0.75 * reads["load read_all"]
        assert reads["load broadcast"] < 0.75 * reads["load read_all"]
    assert data["drive"]["write_gbps"] > 0 and data["drive"]["tool"]
    for text in ("drive limit", "save (all write)", "load broadcast", "per-rank GB/s"):
        assert text in printed
    assert list(tmp_path.iterdir()) == [out]  # the benchmark cleaned up after itself
