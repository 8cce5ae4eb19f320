"""Smoke run of bench/bench_warmup.py (first save of a process vs the next) at a tiny size, so it
cannot rot; no timing asserted."""

from __future__ import annotations

import json

from bench import bench_warmup


def test_bench_warmup_tiny(tmp_path, capsys):
    out = tmp_path / "warm.json"
    record = bench_warmup.main(["--device", "cpu", "--size", "4MiB", "--saves", "2",
                                "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)])
    text = capsys.readouterr().out
    rows = {(r["backend"], r["variant"]): r for r in record["rows"]}
    assert set(rows) == {("auto", "cold"), ("auto", "warm")}
    for r in rows.values():
        assert r["processes"] == 1 and not r["failed"], r
        assert r["first_gbps"] > 0 and r["next_gbps"] > 0
        assert r["used"] in (["direct"], ["buffered"])
    assert "warmup_s" in rows[("auto", "warm")] and "warmup_s" not in rows[("auto", "cold")]
    (warm,) = [r for r in record["runs"] if r["variant"] == "warm"]
    assert warm["warmup"]["staging"].startswith("done") and len(warm["saves"]) == 2
    assert "first/next" in text and "\nauto      warm " in text and "on cpu" in text
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(record["rows"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.json"]  # checkpoints removed
