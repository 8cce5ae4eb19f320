"""Smoke run of bench/bench_hash_cost.py at a tiny size, so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_hash_cost


def test_hash_cost_bench_runs_tiny(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.json"
    record = bench_hash_cost.main(["--size", "2MiB", "--runs", "2", "--dirs", str(tmp_path / "d"),
                                   "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    keys = {"blake3 1 thread", "blake3 AUTO threads", f"{tmp_path / 'd'}: save",
            f"{tmp_path / 'd'}: save content_hash"}
    assert keys <= set(record["medians"]) and all(record["medians"][k] > 0 for k in keys)
    assert "save content_hash / save, paired per run" in printed
    assert list((tmp_path / "d").iterdir()) == []  # every checkpoint removed after its run
