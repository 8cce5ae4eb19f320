"""Young/Daly checkpoint-interval advice: the formulas and `gds-persist advise`."""

from __future__ import annotations

import json
import math

import pytest

from gds_persist import cli
from gds_persist.training.interval import (
    advise,
    daly_interval,
    lost_work,
    parse_duration,
    waste_fraction,
    young_interval,
)


def test_young_and_daly_intervals():
    assert young_interval(2.0, 3600.0) == pytest.approx(120.0)
    # Daly's higher-order estimate stays close to Young's for C << M, and is M for C >= 2M
    assert daly_interval(2.0, 3600.0) == pytest.approx(120.0 * (1 + math.sqrt(2 / 7200) / 3
                                                                + 2 / 7200 / 9) - 2.0)
    assert abs(daly_interval(2.0, 86400.0) / young_interval(2.0, 86400.0) - 1) < 0.01
    assert daly_interval(500.0, 200.0) == 200.0


def test_daly_interval_minimizes_the_waste():
    c, m, r = 30.0, 4 * 3600.0, 120.0
    t = daly_interval(c, m)
    best = waste_fraction(t, c, m, r)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert waste_fraction(t * factor, c, m, r) > best
    assert 0 < best < 0.1


def test_lost_work_is_about_half_an_interval_plus_restart():
    assert lost_work(100.0, 0.0, 1e9) == pytest.approx(50.0)
    assert lost_work(100.0, 10.0, 1e9, restart_s=60.0) == pytest.approx(115.0)
    assert lost_work(3600.0, 0.0, 3600.0) < 1800.0  # failures come early within long intervals


def test_per_iteration_checkpointing_pays_off_only_when_cheap():
    m = 6 * 3600.0
    cheap = advise(5.0, m, iteration_s=1.0, per_iteration_cost_s=1e-5)
    assert cheap.per_iteration is not None and cheap.per_iteration.waste < cheap.optimal.waste
    dear = advise(5.0, m, iteration_s=1.0, per_iteration_cost_s=0.05)
    assert dear.per_iteration is not None and dear.per_iteration.waste > dear.optimal.waste
    assert cheap.per_iteration_break_even_cost_s == pytest.approx(1.0 / (2 * m))
    assert cheap.optimal.interval_iterations == pytest.approx(cheap.optimal.interval_s)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("2.5m", 150), ("24h", 86400),
                                          ("7d", 604800), ("1e3", 1000)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-5", "5 weeks", "nan"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)


def test_cli_text_and_json(capsys):
    assert cli.main(["advise", "--cost", "2.5", "--mtbf", "24h", "--iteration-time", "1.2",
                     "--per-iteration-cost", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "Daly interval (optimal)" in out and "per-iteration checkpointing" in out
    assert cli.main(["advise", "--cost", "30", "--mtbf", "4h", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimal"]["interval_s"] == pytest.approx(daly_interval(30, 14400))


def test_cli_from_bench(tmp_path, capsys):
    bench = {"results": {"none": {"median_s": 0.5},
                         "torch_save": {"median_s": 0.6, "overhead_s": 0.1},
                         "gds_fence": {"median_s": 0.505, "overhead_s": 0.005}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert cli.main(["advise", "--from-bench", str(path), "--mtbf", "1h", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["iteration_s"] == 0.5 and data["optimal"]["cost_s"] == 0.1
    assert data["per_iteration"]["cost_s"] == 0.005
    with pytest.raises(SystemExit, match="no result 'gds_snapshot'"):
        cli.main(["advise", "--from-bench", str(path), "--mtbf", "1h", "--mode", "gds_snapshot"])
