"""Smoke run of the training-loop benchmark at a tiny size so it cannot rot (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_train", os.path.join(REPO, "bench", "bench_train.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_train_tiny(tmp_path, capsys):
    bench = _bench_module()
    out = tmp_path / "bench.json"
    report = bench.main(["--tiny", "--dir", str(tmp_path), "--json", str(out)])
    text = capsys.readouterr().out
    for mode in bench.MODES:
        assert mode in report["results"] and f"\n{mode} " in text
    assert report["results"]["gds_fence"]["samples"] == 2
    assert "overhead_pct" in report["results"]["torch_save"] and "write_s" in report
    assert "machine:" in text and "checkpoint (model + AdamW + step)" in text
    assert json.loads(out.read_text())["results"].keys() == report["results"].keys()
    assert os.listdir(tmp_path) == ["bench.json"]  # its checkpoints are removed
