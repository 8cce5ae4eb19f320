"""Smoke test of bench/bench_deepspeed.py at its --tiny size, without FastPersist's async_io op
(that build takes minutes): every writer it runs writes a file torch.load reads back
bit-exactly, FastPersist is reported as not run with the way to run it, the table is printed
with ratios, and the work directory is removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_deepspeed


def test_deepspeed_benchmark_runs_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds.json"
    record = bench_deepspeed.main(["--tiny", "--dir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(record, default=str))
    ran = ["torch", "gds_persist", "gds_persist-decoupled"]
    assert list(record["seconds"]) == ran and record["checks"] == dict.fromkeys(ran, "ok")
    assert all(len(v) == 1 and v[0] > 0 for v in record["seconds"].values())
    assert set(record["skipped"]) == {"fastpersist-defaults", "fastpersist-tuned"}
    assert all("--fastpersist" in why and "libaio-dev" in why
               for why in record["skipped"].values())
    assert len(record["decoupled_save_returned_s"]) == 1
    rows = [ln for ln in printed.splitlines() if ln.split(" ")[0] in ran]
    assert len(rows) == 3 and rows[0].split()[3] == "1.00"  # torch: x torch = 1
    assert "not run: fastpersist-tuned: pass --fastpersist" in printed
    assert "load average" in printed and "deepspeed 0.19" in printed
    assert list((tmp_path / "work").iterdir()) == []  # the files were removed
