"""Smoke run of the recovery benchmark at a tiny size so it cannot rot (no timing asserted)."""

from __future__ import annotations

import json
import os

from tests.test_bench_train import _bench_module


def test_bench_recovery_tiny(tmp_path, capsys):
    bench = _bench_module("bench_recovery")
    out = tmp_path / "recovery.json"
    drive, mem = tmp_path / "new" / "drive", tmp_path / "new" / "mem"  # made by the benchmark
    report = bench.main(["--tiny", "--dir", str(drive), "--memory-dir", str(mem),
                         "--cache", "per-file", "--json", str(out)])
    text = capsys.readouterr().out
    results = report["results"]
    assert results["memory"]["sources"] == ["memory"] * 4
    assert results["replica"]["sources"] == ["memory", "memory", "replica", "replica"]
    assert results["drive"]["sources"] == ["drive"] * 4 and results["drive"]["cache"] == "fadvise"
    for src in bench.SOURCES:
        assert f"\n{src} " in text and results[src]["restore_s"] > 0
    assert "target memory >= 3x the drive" in text and "target replica >= 1.5x" in text
    assert "\nfloor " in text and results["floor"]["restore_s"] > 0  # measured beside them
    assert "at most" in text
    assert "tier per node after training" in text and len(report["tier_bytes_per_node"]) == 2
    # the levels configuration: node n1 lost, then every node-local directory (a fresh job)
    nearest, _, lost, _ = results["peers"]["sources"]  # n0's level ("local" on this tmp_path)
    assert nearest not in ("replica", "drive") and lost == "replica"
    assert results["durable"]["sources"] == ["drive"] * 4
    assert results["durable"]["cache"] == "fadvise" and results["peers"]["x_durable_restore_s"] > 0
    assert "target peers >= 1.5x the cold durable restore" in text and "\nfloor " in text
    assert results["levels_floor"]["restore_s"] > 0
    held = report["levels_trained"]["bytes_per_node"]
    assert sorted(held) == ["n0", "n1"] and all(n["tmpfs"] > 0 and n["disk"] > 0
                                                for n in held.values())
    assert "level bytes on n1: tmpfs" in text and report["levels_trained"]["flush"]["flushed"]
    assert json.loads(out.read_text())["results"].keys() == results.keys()
    assert os.listdir(drive) == [] and os.listdir(mem) == []  # everything it wrote is removed
