"""Smoke runs of the training-loop and GIL benchmarks at a tiny size so they cannot rot (no
timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module(name: str = "bench_train"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a spawned writer process unpickles its functions by module name
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
    auto = report["results"]["gds_auto"]  # CPU state: the default Checkpointer fences
    assert auto["mode"] == "fence" and auto["mode_reason"].startswith("auto: CPU-only state")
    assert "chose fence" in text and "gds_auto: auto: CPU-only state" in text
    assert "overhead_pct" in report["results"]["torch_save"] and "write_s" in report
    for r in report["results"].values():  # one round: the paired overhead is that round's
        assert r["paired_overhead_pct"] == pytest.approx(r["overhead_pct"])
        assert r["runq_s_per_iter"] >= 0
    assert "core ms" in text and "gds_memory - gds_snapshot: " in text
    assert "machine:" in text and "checkpoint (model + AdamW + step)" in text
    assert json.loads(out.read_text())["results"].keys() == report["results"].keys()
    assert os.listdir(tmp_path) == ["bench.json"]  # its checkpoints are removed


def test_bench_train_levels_flush_during_the_timed_iterations(tmp_path, capsys):
    bench = _bench_module()
    report = bench.main(["--tiny", "--dir", str(tmp_path), "--modes", "gds_snapshot,gds_levels",
                         "--drive-every", "1", "--local-every", "1"])
    text = capsys.readouterr().out
    levels = report["results"]["gds_levels"]
    assert levels["level_commits"] == {"memory": 2, "local": 2}  # both timed iterations
    assert levels["flushed_with_close"] >= 1 and levels["flush_failures"] == 0
    assert "flushes to the durable root" in text and "gds_levels - gds_snapshot: " in text
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("variant", ["batchnorm", "frozen"])
def test_bench_train_variants_pair_the_capture_with_it_switched_off(tmp_path, capsys, variant):
    bench = _bench_module()
    modes = "gds_fence,gds_fence_uncaptured,gds_snapshot,gds_snapshot_uncaptured"
    report = bench.main(["--tiny", "--dir", str(tmp_path), "--variant", variant, "--modes", modes])
    text = capsys.readouterr().out
    assert f"model: GPT ({variant})" in text
    for mode in ("gds_fence", "gds_snapshot"):
        assert f"{mode} - {mode}_uncaptured: " in text
        assert "what capturing every tensor costs" in text
        assert report["results"][f"{mode}_uncaptured"]["samples"] == 2


def test_gil_contention_tiny(tmp_path, capsys):
    bench = _bench_module("gil_contention")
    out = tmp_path / "gil.json"
    report = bench.main(["--tiny", "--dir", str(tmp_path), "--json", str(out)])
    text = capsys.readouterr().out
    rows = report["python"]["rows"]
    assert set(rows) == {"none", "thread", "process"} and "GIL wait" in text
    assert all(r["iterations"] == 2 and r["gil_wait_ms_per_iter"] >= 0 for r in rows.values())
    assert json.loads(out.read_text())["python"]["rows"].keys() == rows.keys()
    assert os.listdir(tmp_path) == ["gil.json"]


def test_bench_trainers_tiny(tmp_path, capsys):
    bench = _bench_module("bench_trainers")
    out = tmp_path / "trainers.json"
    report = bench.main(["--tiny", "--dir", str(tmp_path), "--json", str(out)])
    text = capsys.readouterr().out
    for method in bench.METHODS:
        assert f"\n{method} " in text
        r = report["results"][method]
        assert r["samples"] >= 2 and r["step_ms"] > 0
        if method != "none":
            assert r["blocking_ms"] > 0 and r["durable_ms"] > 0 and r["checkpoint_mb"] > 0
    assert "every write includes fsync" in text
    assert json.loads(out.read_text())["results"].keys() == report["results"].keys()
    assert os.listdir(tmp_path) == ["trainers.json"]  # its checkpoints are removed
