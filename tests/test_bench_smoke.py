"""Smoke test of the comparison benchmark (bench/bench_io.py) at a tiny size, so it cannot rot.

Runs in-process in a few seconds; needs neither root nor fio, but uses them when present (page
cache dropped as root; fio for the drive limit when installed).
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from bench import bench_io, drive, methods
from gds_persist.backends import supports_o_direct
from gds_persist.format import checksum


def test_benchmark_runs_tiny_and_reports_every_method(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    out_svg = tmp_path / "chart" / "bench.svg"  # make bench's --svg, into a new folder
    record = bench_io.main(["--size", "4MiB", "--runs", "2", "--dir", str(tmp_path),
                            "--json", str(out_json), "--dcp-threads", "1,2",
                            "--svg", str(out_svg)])
    captured = capsys.readouterr()
    printed = captured.out

    expected = {"gds-buffered", "torch", "dcp", "safetensors"}
    if supports_o_direct(str(tmp_path))[0]:
        expected.add("gds-direct")
    assert f"SVG chart written to {out_svg}" in printed
    assert ET.parse(out_svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    data = json.loads(out_json.read_text())
    assert data["schema"] == "gds_persist-bench/1"
    assert data == json.loads(json.dumps(record, default=str))
    assert data["config"]["warmup"] == 1 and "warm-up 1/1 (untimed)" in captured.err
    assert all(len(s["seconds"]) == 2 for s in data["series"])  # the warm-up is not timed
    available = {m["key"] for m in data["methods"] if m["available"]}
    assert expected <= available
    assert {m["key"] for m in data["methods"]} == set(methods.REGISTRY)  # the rest listed...
    for m in data["methods"]:
        if not m["available"]:
            assert m["reason"]  # ...with the reason
            assert f"not run: {m['label']}: {m['reason']}" in printed
        else:
            assert m["failed"] is None, m
            assert m["check"] == "ok", m  # every method's first load matched the source
            assert m["disk_bytes"] > 0

    # header facts, the drive limit and how the cache was handled
    for key in ("cpu", "cores", "memory_bytes", "filesystem", "block_device", "gpu", "versions"):
        assert key in data["machine"]
    assert data["drive"]["tool"].startswith("fio" if shutil.which("fio") else "python")
    assert data["cache"]["how"] in ("drop_caches", "fadvise", "none")
    assert set(data["cache"]["resident_before_load"]) <= available  # cached bytes, per method
    for line in ("CPU", "directory", "GPU", "versions", "state", "cold load", "drive"):
        assert f"  {line} " in printed
    assert data["machine"]["versions"]["host_crc32c"] == checksum.IMPLEMENTATION
    assert f"host CRC32C {checksum.IMPLEMENTATION}" in printed  # which CRC the figures paid for

    # one fixed-width row per method and operation, plus the drive limit, with raw timings
    rows = {(r["op"], r["key"]): r for r in data["rows"]}
    drives = {"drive", "drive-1"} if shutil.which("fio") else {"drive"}  # fio: N jobs and 1 job
    drives.add("limit")  # the aligned writer (bench/bench_limit.py), in every repetition
    assert set(rows) == {(op, k) for op in ("save", "load") for k in available | drives}
    for op in ("save", "load"):
        assert rows[(op, "limit")]["x_limit"] == pytest.approx(1.0)
        assert rows[(op, "torch")]["x_limit"] > 0
    assert "x limit" in printed and "aligned-writer limit" in printed
    for (_op, key), r in rows.items():
        assert r["runs"] == 2
        assert r["gbps"]["median"] > 0 and r["gbps"]["min"] <= r["gbps"]["max"]
        assert r["x_drive"] > 0 and r["x_baseline"] > 0
        if key == "torch":
            assert r["x_baseline"] == pytest.approx(1.0)
    for s in data["series"]:
        assert len(s["seconds"]) == 2 and all(t > 0 for t in s["seconds"])
    table = [ln for ln in printed.splitlines() if ln.startswith(("save ", "load "))]
    assert len(table) == len(rows)
    assert len({len(ln.split("  ")[0]) for ln in table}) == 1  # fixed-width op column
    for label in ("torch.save", "torch.load", "gds_persist buffered", "DCP FileSystemWriter",
                  "DCP FileSystemReader", "safetensors save_file", "safetensors load_file"):
        assert any(label in ln for ln in table), label
    assert len(data["order"]) == 2 and data["order"][0] != data["order"][1]  # rotated
    assert "elapsed" in printed
    assert not [p for p in tmp_path.iterdir() if p.name not in ("bench.json", "chart")]  # tidy


def test_method_subset_and_png_message(tmp_path, capsys):
    png = tmp_path / "bench.png"
    data = bench_io.main(["--size", "1MiB", "--runs", "1", "--dir", str(tmp_path),
                          "--methods", "torch,gds-buffered", "--no-fio", "--png", str(png),
                          "--cache-drop", "per-file"])
    printed = capsys.readouterr().out
    assert [m["key"] for m in data["methods"]] == ["torch", "gds-buffered"]
    assert data["drive"]["tool"].startswith("python")
    assert data["cache"]["how"] == "fadvise"
    assert "posix_fadvise(DONTNEED)" in printed
    assert "NOTE       drive limit from a plain Python stream, not fio" in printed
    assert ("PNG written" in printed and png.stat().st_size > 0) or "PNG skipped" in printed


def test_unknown_method_is_named(tmp_path):
    with pytest.raises(SystemExit, match="unknown method.*nope.*choose from"):
        bench_io.main(["--size", "1MiB", "--dir", str(tmp_path), "--methods", "nope"])


@pytest.mark.parametrize(("text", "value"), [("2GiB", 2 << 30), ("8MiB", 8 << 20),
                                             ("512MB", 512 * 10**6), ("1.5g", 1_500_000_000),
                                             ("1048576", 1 << 20)])
def test_parse_size(text, value):
    assert bench_io.parse_size(text) == value


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_python_drive_stream_round_trips(tmp_path, o_direct):
    if o_direct and not supports_o_direct(str(tmp_path))[0]:
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    probe = drive.DriveProbe(str(tmp_path), 3 << 20, use_fio=False, o_direct=o_direct)
    assert probe.tool.startswith("python O_DIRECT" if o_direct else "python buffered")
    w, r = probe.write(), probe.read()
    assert w.nbytes == r.nbytes == 3 << 20 and w.seconds > 0 and r.seconds > 0
    probe.cleanup()
    assert not list(tmp_path.iterdir())


def test_fio_json_parse_skips_notes():
    text = 'note: both iodepth >= 1 and synchronous I/O engine\n{"jobs": [{"write": {}}]}'
    assert drive.parse_fio_json(text) == {"jobs": [{"write": {}}]}


def test_touch_pages_counts_each_storage_once():
    import torch

    from bench.methods import touch_pages

    a = torch.zeros(3000, dtype=torch.float32)
    assert touch_pages([a, a[10:], a.view(30, 100)]) == 12000
    assert touch_pages([torch.empty(0)]) == 0


def test_registry_variant_row(tmp_path, capsys, monkeypatch):
    """A new row is one register() call (as issues 5/6 add kvikio-compat and DCP rows)."""
    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    methods.register(lambda: methods.GdsPersist("buffered", variant="tiny-ring",
                                                settings={"block_bytes": 1 << 20,
                                                          "staging_bytes": 2 << 20}),
                     key="gds-buffered-tiny-ring")
    data = bench_io.main(["--size", "1MiB", "--runs", "1", "--dir", str(tmp_path), "--no-fio",
                          "--methods", "torch,gds-buffered-tiny-ring", "--cache-drop", "per-file"])
    printed = capsys.readouterr().out
    assert any(ln.startswith("save  gds_persist buffered tiny-ring") for ln in printed.splitlines())
    (entry,) = [m for m in data["methods"] if m["key"] == "gds-buffered-tiny-ring"]
    assert entry["check"] == "ok" and "block_bytes=1048576" in entry["notes"][0]
    with pytest.raises(ValueError, match="already registered"):
        methods.register(methods.TorchSave)


def test_a_failing_method_is_reported_and_the_rest_still_run(tmp_path, capsys, monkeypatch):
    class Broken(methods.Method):
        key, label = "broken", "broken writer"

        def save(self, ctx, path):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    methods.register(Broken)
    data = bench_io.main(["--size", "1MiB", "--runs", "2", "--dir", str(tmp_path), "--no-fio",
                          "--methods", "broken,torch", "--cache-drop", "per-file"])
    printed = capsys.readouterr().out
    assert "FAILED (no row): broken writer: OSError: [Errno 28] No space left on device" in printed
    assert {r["key"] for r in data["rows"]} == {"limit", "drive", "torch"}
    assert all(r["runs"] == 2 for r in data["rows"])
    assert data["order"][1] == ["torch", "drive"]  # dropped from the later repetitions


def test_stage_profile_runs_tiny_and_names_the_stages(tmp_path, capsys):
    """bench/profile_stages.py: every stage of a save and a load is timed and printed."""
    from bench import profile_stages

    out = tmp_path / "profile.json"
    assert profile_stages.main(["--size", "2MiB", "--dir", str(tmp_path), "--runs", "1",
                                "--cache-drop", "per-file", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    save_stages = {r["stage"] for r in data["save"]["stages"]}
    load_stages = {r["stage"] for r in data["load"]["stages"]}
    assert {"flatten", "checksum", "write", "fsync"} <= save_stages, save_stages
    assert {"open (manifest, data files)", "read", "checksum"} <= load_stages, load_stages
    assert all(r["thread_s"] >= 0 and r["calls"] >= 1 for r in data["save"]["stages"])
    assert "lowest bound:" in printed
    assert list(tmp_path.iterdir()) == [out]  # the checkpoints it wrote are gone


def test_bench_limit_pairs_the_aligned_writer_with_save(tmp_path, capsys):
    from bench import bench_limit

    times = bench_limit.main(["--size", "2MiB", "--runs", "2", "--dir", str(tmp_path)])
    assert len(times["limit"]) == len(times["checksummed"]) == len(times["save"]) == 2
    assert min(times["limit"]) > 0 and min(times["checksummed"]) > 0
    printed = capsys.readouterr().out
    assert "aligned writer (O_DIRECT pwrite" in printed or "buffered+fsync" in printed
    assert "save / limit per pair" in printed and "save / checksummed per pair" in printed
    assert "checksummed writer" in printed
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # its files and checkpoints gone



def test_the_kvikio_row_names_the_io_that_ran():
    """The H200's KvikIO compatibility mode (taken by KvikIO itself) was labelled "cuFile compat";
    each mode gds_mode() describes gets its own name, and all fit the table's 30 characters."""
    import kvikio
    import kvikio.defaults

    from gds_persist.backends.kvikio_backend import gds_mode

    with kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON):  # the real forced mode
        forced = gds_mode(kvikio)
    modes = [forced,
             (False, "KvikIO compatibility mode (KvikIO found no usable libcufile/GDS setup)"),
             (False, "cuFile compatibility mode (POSIX inside cuFile; nvidia-fs not loaded)"),
             (True, "GPUDirect Storage (cuFile with the nvidia-fs driver)")]
    labels = [methods.kvikio_label(*m) for m in modes]
    assert labels == ["gds_persist kvikio (KvikIO ON)", "gds_persist kvikio (KvikIO)",
                      "gds_persist kvikio (cuFile)", "gds_persist kvikio (GDS)"]
    assert max(map(len, labels)) <= 30
