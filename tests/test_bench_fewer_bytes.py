"""Smoke test of bench/bench_fewer_bytes.py at a tiny size, so it cannot rot."""

from __future__ import annotations

import json

from bench import bench_fewer_bytes


def test_fewer_bytes_benchmark_runs_tiny(tmp_path, capsys):
    out_json, out_txt = tmp_path / "b.json", tmp_path / "b.txt"
    record = bench_fewer_bytes.main(["--tiny", "--dir", str(tmp_path), "--no-fio",
                                     "--json", str(out_json), "--txt", str(out_txt)])
    printed = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["schema"] == "gds_persist-bench-fewer-bytes/1"
    ft = data["finetune"]
    assert ft["all_exact"] and len(ft["runs"]) == 2
    assert all(s["referenced"] > 0 for run in ft["runs"] for s in run["saves"][1:])
    assert ft["x_fio_from_second"]["median"] > 0
    floor = ft["runs"][0]["changed_alone"]
    assert 0 < floor["nbytes"] < ft["runs"][0]["saves"][0]["payload"]
    assert floor["save_s"] > 0 and floor["fio_s"] > 0
    assert ft["incremental_over_changed_alone"]["median"] > 0
    tr = data["trained"]
    assert set(tr["kinds"]) == {*bench_fewer_bytes.KINDS, "all"}
    assert all(k["exact"] for k in tr["kinds"].values())
    assert "disk" in tr["targets"]
    for target in tr["targets"].values():
        for kind in target["x_fio"].values():
            assert kind["none"]["median"] > 0 and kind["auto"]["median"] > 0
    assert "2nd checkpoint on" in printed and "changed bytes alone" in printed
    assert "auto's reason" in printed
    assert out_txt.read_text().count("fine-tuning") >= 1
    assert record["tiny"] is True
