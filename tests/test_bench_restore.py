"""Smoke test of bench/bench_restore.py at its --tiny size (so it cannot rot), and its bit-exact
check on live objects that were and were not restored."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench import bench_restore
from bench.bench_fewer_bytes import fingerprints
from bench.state import choose_shape, iter_tensors


def test_restore_benchmark_runs_tiny_and_reports_every_method(tmp_path, capsys):
    out = tmp_path / "restore.json"
    record = bench_restore.main(["--tiny", "--dir", str(tmp_path), "--json", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(record, default=str))
    assert data["failed"] == {}
    ran = {r["key"] for r in data["rows"]}
    assert data["skipped"] == {} and ran == {*bench_restore.METHODS, "fio"}
    for r in data["rows"]:
        assert r["runs"] == 1 and r["seconds"]["median"] > 0
        if r["key"] == "fio":
            continue
        (res,) = data["results"][r["key"]]
        assert res["check"] == "ok", r["key"]  # every tensor and the lr came back bit-exact
        assert res["hwm_reset"] and res["hwm_growth"] >= 0 and res["cuda_growth"] is None
    rows = {r["key"]: r for r in data["rows"]}
    assert rows["torch"]["x_baseline"] == pytest.approx(1.0)
    assert data["x_mmap"]["torch-mmap"] == pytest.approx(1.0)
    assert rows["gds"]["x_drive"] > 0
    assert data["drive"]["tool"].startswith("fio" if shutil.which("fio") else "python")
    table = [ln for ln in printed.splitlines()
             if any(ln.startswith(bench_restore.METHODS[k].label[:31]) for k in ran - {"fio"})]
    assert len(table) == len(ran) - 1
    assert len({ln.index("  ", 31) for ln in table}) == 1  # fixed width
    for line in ("CPU", "directory", "state", "runs", "cold load", "drive"):
        assert f"  {line} " in printed
    assert list(tmp_path.iterdir()) == [out]  # checkpoints and fio files removed


def test_unknown_method_is_named(tmp_path):
    with pytest.raises(SystemExit, match="unknown method.*nope.*choose from"):
        bench_restore.main(["--tiny", "--dir", str(tmp_path), "--methods", "torch,nope"])


def test_check_finds_what_a_restore_missed():
    """The check compares with the saved state's fingerprints, not with whatever the live
    objects hold."""
    shape = choose_shape(1 << 20, "fp32")
    model, opt = bench_restore.build_live(shape, torch.device("cpu"))
    state = bench_restore.live_state(model, opt)
    canon = bench_restore.canonical_keys(state)
    assert canon["model.head.weight"] == "model.tok.weight"  # the tie: one saved value
    saved, _ = bench_restore.build_live(shape, torch.device("cpu"))
    with torch.no_grad():
        for key, t in iter_tensors(bench_restore.live_state(saved, opt)):
            t.copy_(bench_restore.saved_value(canon[key], t, seed=0))
    expected = fingerprints(bench_restore.live_state(saved, opt))
    assert "tensor(s) differ from the saved ones" in bench_restore.check(model, opt, expected)
    model.load_state_dict(saved.state_dict())
    assert "learning rate" in bench_restore.check(model, opt, expected)
    opt.param_groups[0]["lr"] = bench_restore.SAVED_LR
    assert bench_restore.check(model, opt, expected) == "ok"
    model.head.weight.data[0, 0] += 1  # one element of the tied LM head (= the embedding)
    assert "2 tensor(s) differ" in bench_restore.check(model, opt, expected)
