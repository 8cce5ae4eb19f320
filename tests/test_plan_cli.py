"""``gds-persist plan``: the data-parallel scale model, as a user runs it."""

from __future__ import annotations

import json

import pytest

from gds_persist.advice.scale import Scenario, bytes_split, gpt_shape, gpt_storage_sizes, predict
from gds_persist.cli import main


def test_plan_prints_balance_times_and_iteration_fraction(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "13e9", "--bytes-per-param", "14", "--dp", "64",
                 "--gpus-per-node", "8", "--drives-per-node", "8", "--drive-gbps", "3.0",
                 "--iteration-s", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "182.2 GB" in out and "64 data-parallel GPUs on 8 node(s)" in out
    assert "bytes per writer max/mean 1.0000" in out
    assert "single writer (one rank, one drive)" in out and "60.730 s" in out
    assert "partitioned (64 writers)" in out and "0.949 s" in out and "speed-up 64.0x" in out


def test_sweep_table_shows_fastpersists_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "13e9", "--sweep", "--iteration-s", "25"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[3:]]
    assert [int(r[0]) for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
    single_pct = [float(r[6].rstrip("%")) for r in rows]
    part_pct = [float(r[8].rstrip("%")) for r in rows]
    assert single_pct == sorted(single_pct) and single_pct[-1] > 100 * single_pct[0] / 2
    assert max(part_pct) - min(part_pct) < 1.0  # partitioned: a constant share of an iteration


def test_plan_assumes_no_iteration_time(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --iteration-s the times are printed alone, never as a share of a made-up one."""
    assert main(["plan", "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "4.677 s" in out and "0.585 s" in out and "iteration\n" not in out.split("(give")[0]
    assert "%" not in out and "(give --iteration-s, the seconds of one training iteration" in out
    assert main(["plan", "--params", "1e9", "--sweep", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "%iter" not in out and "iter s" not in out and "scaling from" not in out
    assert [line.split()[-1] for line in out.splitlines()[3:5]] == ["8x", "16x"]
    assert "(give --iteration-s" in out
    assert main(["plan", "--params", "1e9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["iteration_s"] is None and data["single_writer_fraction_of_iteration"] is None
    assert data["single_writer_s"] == pytest.approx(4.677, abs=1e-3)


def test_plan_json_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "1.3e9", "--dp", "32", "--writers-per-node", "2",
                 "--drives-per-node", "2", "--node-gbps", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["writers"] == 8 and data["nodes"] == 4
    assert data["writer_balance"] <= 1.01
    # 2 writers per node at 3 GB/s each would make 6 GB/s; the 4 GB/s node cap binds
    assert data["partitioned_s"] == pytest.approx(data["checkpoint_bytes"] / 4 / 4e9)
    assert main(["plan", "--params", "1.3e9", "--sweep", "8,16", "--json",
                 "--scaling", "weak"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dp"] for r in rows] == [8, 16] and rows[0]["iteration_s"] == rows[1]["iteration_s"]


@pytest.mark.parametrize("args", [["--dp", "0"], ["--drive-gbps", "-1"], ["--dp", "2.5"],
                                  ["--params", "x"]])
def test_plan_rejects_bad_numbers(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "1e9", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("not a positive" in err or "invalid" in err), err


def test_plan_rejects_a_bad_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "1e9", "--sweep", "8,x"]) == 2
    assert "comma-separated list of GPU counts" in capsys.readouterr().err


def test_scale_model_pieces() -> None:
    assert bytes_split(14) == (2, [4, 4, 4]) and bytes_split(16) == (4, [4, 4, 4])
    assert bytes_split(2) == (2, []) and bytes_split(7) == (4, [3])
    layers, hidden = gpt_shape(13e9)
    assert layers == 40 and 5000 < hidden < 5300
    sizes = gpt_storage_sizes(125e6)
    assert abs(sum(sizes) / 14 / 125e6 - 1) < 0.02 and sizes.count(4) >= 148  # Adam steps
    p = predict(Scenario(13e9, dp=8))
    assert p.single_s / p.partitioned_s == pytest.approx(8, rel=1e-3)
