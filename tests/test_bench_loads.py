"""bench/bench_loads.py at a tiny size, so the paired-loads benchmark cannot rot: every arm runs
every round of every process, each file is read as often as the other, the restores it times
are right, and its aligned reader reads every byte."""

from __future__ import annotations

import json
import os

import pytest
import torch

import gds_persist
from bench import bench_loads
from gds_persist.backends import supports_o_direct


def test_every_arm_runs_every_round_and_both_files_are_read_alike(tmp_path, capsys):
    out = tmp_path / "loads.json"
    # no pause before each arm: it is for the host's memory at 1 GiB, not for 4 MiB smoke runs
    record = bench_loads.main(["--size", "4MiB", "--processes", "2", "--rounds", "1",
                               "--dir", str(tmp_path / "d"), "--json", str(out),
                               "--settle", "0"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record, default=str))
    times = record["times"]
    assert len(times) == len(bench_loads.DIR_ARMS) + len(bench_loads.PT_ARMS)
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    per_file = [sum(n.startswith(f"{f} ") for n in times) for f in ("dir", "pt")]
    assert per_file[0] == per_file[1]  # neither file hotter in the host's cache
    for key, rows in (("comparisons", bench_loads.COMPARISONS),
                      ("placebos", bench_loads.PLACEBOS)):
        assert [s["name"] for s in record[key]] == [name for name, _, _ in rows]
        for s, (_, ours, theirs) in zip(record[key], rows, strict=True):
            assert s["per_round"] == [t / o for o, t in zip(times[ours], times[theirs],
                                                            strict=True)]
            assert s["min"] <= s["median"] <= s["max"]
    assert record["config"]["backend"] == "auto"  # the library's default read
    assert record["config"]["settle_s"] == 0
    printed = capsys.readouterr().out
    assert "load(dir) x torch.load" in printed and "bound(dir) x bound(pt)" in printed
    assert "process 0: load(dir) x torch.load" in printed and "process 1:" in printed
    assert record["config"]["processes"] == 2
    assert not [p for p in (tmp_path / "d").rglob("*") if p.is_file()]  # its files are gone


def _saved(tmp_path, state):
    paths = {"dir": str(tmp_path / "ck"), "pt": str(tmp_path / "gds.pt")}
    gds_persist.save(state, paths["dir"])
    gds_persist.save(state, paths["pt"], format="torch")
    return paths


def test_a_restore_that_differs_from_the_saved_state_stops_the_benchmark(tmp_path):
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    paths = _saved(tmp_path, state)
    live = {"w": torch.zeros(4096)}
    bench_loads.check_restores(paths, live, state)  # right: passes, live restored
    assert torch.equal(live["w"], state["w"])
    other = {"w": state["w"] + 1}
    with pytest.raises(SystemExit, match=r"dir: restored tensors differ .*\['w'\]"):
        bench_loads.check_restores(paths, live, other)


def test_the_aligned_reader_reads_every_byte_of_files_of_any_size(tmp_path):
    sizes = [1, 4095, 4096, 3 * (1 << 20) + 17]
    files = []
    for k, n in enumerate(sizes):
        p = tmp_path / f"f{k}"
        p.write_bytes(os.urandom(n))
        files.append(str(p))
    reader = bench_loads.AlignedReader(2, 1 << 20, supports_o_direct(str(tmp_path))[0])
    try:
        assert reader.read(files) == sum(sizes)
        assert reader.read(files[-1:]) == sizes[-1]  # one file: a part per thread
        assert reader.streams(files[-1:]) == [(files[-1], 0, 2 << 20),
                                              (files[-1], 2 << 20, sizes[-1])]
    finally:
        reader.close()


def test_the_backend_option_reads_with_that_backend(tmp_path, capsys):
    """docs/BENCHMARK.md runs it with ``--backend buffered``: ours then load with it."""
    record = bench_loads.main(["--size", "4MiB", "--processes", "1", "--rounds", "1",
                               "--dir", str(tmp_path), "--settle", "0", "--backend", "buffered"])
    assert record["config"]["backend"] == "buffered"
    assert "backend buffered" in capsys.readouterr().out
    assert all(len(t) == 1 for t in record["times"].values())
    # the option reaches gds_persist.load
    with pytest.raises(gds_persist.BackendError, match="unknown backend .nonsense."):
        bench_loads.main(["--size", "4MiB", "--processes", "1", "--rounds", "1", "--dir",
                          str(tmp_path), "--settle", "0", "--backend", "nonsense"])
