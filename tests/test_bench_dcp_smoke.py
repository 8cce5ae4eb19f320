"""Smoke test of bench/bench_dcp.py (DCP with several ranks) at a tiny size, so it cannot rot."""

from __future__ import annotations

import pytest

from bench import bench_dcp


@pytest.mark.slow
def test_bench_dcp_runs_and_shows_the_imbalance(tmp_path, capsys):
    record = bench_dcp.main(
        [
            "--size",
            "2MiB",
            "--runs",
            "1",
            "--ranks",
            "2",
            "--dir",
            str(tmp_path),
            "--dominant",
            "0.6",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    printed = capsys.readouterr().out
    for label in bench_dcp.METHODS.values():
        assert label in printed
    per_rank = record["rank_bytes"]
    ratio = {k: max(v) / (sum(v) / len(v)) for k, v in per_rank.items()}
    assert ratio["dcp-fs"] > 1.3 and ratio["dcp-gds"] > 1.3  # one rank has the flat buffer
    assert ratio["dcp-gds-balanced"] < 1.1
    assert all(len(s["save"]) == 1 and s["save"][0] > 0 for s in record["series"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # cleaned up
