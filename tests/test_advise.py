"""Young/Daly checkpoint-interval advice: the formulas and `gds-persist advise`."""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import doc_command

from gds_persist import cli
from gds_persist.advice.interval import (
    advise,
    daly_interval,
    lost_work,
    waste_fraction,
    young_interval,
)
from gds_persist.advice.levels import Failures, Tier, advise_levels, describe_levels
from gds_persist.advice.units import parse_duration, parse_size
from gds_persist.advice.wear import endurance, wear_interval, writes_per_day
from gds_persist.backends import write_rate


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


# --- two levels: memory_every, drive_every, and the drive's wear ---------------------------------

H, D = 3600.0, 86400.0
CKPT_13B = 13e9 * 14  # bytes: a 13B model, mixed-precision Adam
ONE_DWPD = endurance(dwpd=1.0, capacity_bytes=3.84e12)


MEMORY, REPLICA, DRIVE = Tier(0.05, 5.0), Tier(0.2, 30.0), Tier(60.0, 300.0)
FAILURES = Failures(8 * H, 1 * D, 30 * D)


def _levels(iteration_s=1e-3, memory=MEMORY, replica=REPLICA, drive=DRIVE, failures=FAILURES,
            **kw):
    return advise_levels(iteration_s, memory, drive, failures, replica=replica, **kw)


def test_each_level_gets_young_daly_for_its_own_cost_and_failures():
    a = _levels()
    m1 = 1 / (1 / (8 * H) + 1 / D)  # process and node failures: both recovered by memory_every
    assert a.memory.mtbf_s == pytest.approx(m1) and a.memory.cost_s == pytest.approx(0.25)
    assert a.memory.young_interval_s == pytest.approx(math.sqrt(2 * 0.25 * m1))
    assert a.memory.daly_interval_s == pytest.approx(daly_interval(0.25, m1))
    assert a.drive.mtbf_s == pytest.approx(30 * D)
    assert a.drive.young_interval_s == pytest.approx(math.sqrt(2 * 60 * 30 * D))
    # with short iterations the rounding and nesting move each interval by well under 1%
    assert a.memory.interval_s == pytest.approx(a.memory.daly_interval_s, rel=0.01)
    assert a.drive.interval_s == pytest.approx(a.drive.daly_interval_s, rel=0.01)
    assert a.drive.every % a.memory.every == 0
    assert (a.memory.limited_by, a.drive.limited_by) == ("failures", "failures")
    # Benoit et al.'s first-order optimum: sum of sqrt(2 lambda C) + lambda R over the levels
    first_order = (math.sqrt(2 * 0.25 / m1) + (5 / (8 * H) + 30 / D)
                   + math.sqrt(2 * 60 / (30 * D)) + 300 / (30 * D))
    assert a.waste == pytest.approx(first_order, rel=0.02)
    assert a.waste == pytest.approx(a.memory.waste + a.drive.waste)


def test_lost_work_per_failure_class_is_half_its_level_interval_plus_its_restore():
    a = _levels()
    assert a.recovered_from == {"process": "memory", "node": "replica", "replica_loss": "drive"}
    t1, t2 = a.memory.interval_s + 0.25, a.drive.interval_s + 60
    assert a.lost_per_failure_s["process"] == pytest.approx(t1 / 2 + 5.0, rel=0.01)
    assert a.lost_per_failure_s["node"] == pytest.approx(t1 / 2 + 30.0, rel=0.01)
    assert a.lost_per_failure_s["replica_loss"] == pytest.approx(t2 / 2 + 300.0, rel=0.01)
    assert a.lost_per_failure_s["replica_loss"] == lost_work(a.drive.interval_s, 60.0, 30 * D,
                                                             300.0)


def test_without_replicas_node_failures_fall_to_the_drive():
    a = _levels(replicas=0)
    assert a.replicas == 0 and a.recovered_from["node"] == "drive"
    assert a.memory.mtbf_s == pytest.approx(8 * H) and a.memory.cost_s == pytest.approx(0.05)
    assert a.drive.mtbf_s == pytest.approx(1 / (1 / D + 1 / (30 * D)))
    assert a.lost_per_failure_s["node"] == a.lost_per_failure_s["replica_loss"]
    assert a.drive.interval_s < _levels().drive.interval_s  # more failures need the drive


def test_intervals_are_whole_nested_iterations():
    a = _levels(iteration_s=7.0)
    assert a.memory.interval_s == 7.0 * a.memory.every
    assert a.drive.every % a.memory.every == 0 and a.drive.every > a.memory.every
    free = _levels(iteration_s=1.0, memory=Tier(0.0), replica=Tier(0.0))
    assert free.memory.every == 1 and free.memory.limited_by == "iteration"
    # a drive cheaper than the memory tier: memory steps are never sparser than drive steps
    odd = _levels(iteration_s=1.0, memory=Tier(30.0), replica=None, drive=Tier(0.01),
                  replicas=0)
    assert odd.memory.every == odd.drive.every and odd.memory.limited_by == "drive_every"
    assert "a memory tier dearer than the drive may not pay" in "\n".join(describe_levels(odd))


@pytest.mark.parametrize("scale", [0.25, 1.0, 4.0, 16.0])
def test_fewer_failures_or_dearer_checkpoints_mean_sparser_checkpoints(scale):
    def at(mtbf_scale=1.0, memory=MEMORY, drive=DRIVE):
        return _levels(iteration_s=0.5, memory=memory, drive=drive, failures=Failures(
            8 * H * mtbf_scale, D * mtbf_scale, 30 * D * mtbf_scale))

    often, rarer = at(scale), at(2 * scale)
    assert rarer.memory.every >= often.memory.every and rarer.drive.every >= often.drive.every
    assert rarer.waste < often.waste
    cheap, dear = at(drive=Tier(60.0 * scale, 300.0)), at(drive=Tier(120.0 * scale, 300.0))
    assert dear.drive.every > cheap.drive.every
    assert dear.lost_per_failure_s["replica_loss"] > cheap.lost_per_failure_s["replica_loss"]
    cheap, dear = at(memory=Tier(0.05 * scale)), at(memory=Tier(0.1 * scale))
    assert dear.memory.every > cheap.memory.every
    assert dear.lost_per_failure_s["process"] > cheap.lost_per_failure_s["process"]


def test_wear_budget_from_tbw_or_dwpd():
    assert ONE_DWPD.bytes_per_day == 3.84e12
    tbw = endurance(tbw=7000.0, warranty_years=5.0)
    assert tbw.bytes_per_day == pytest.approx(7000e12 / (5 * 365))
    assert tbw.total_bytes == pytest.approx(7000e12)
    assert wear_interval(CKPT_13B, ONE_DWPD) == pytest.approx(CKPT_13B * D / 3.84e12)  # 4095 s
    assert wear_interval(CKPT_13B, ONE_DWPD, share=0.5) == pytest.approx(2 * 4095.0)
    # per-iteration checkpoints of a 13B model to one drive, one iteration a second: petabytes
    assert writes_per_day(CKPT_13B, 1.0) == pytest.approx(182e9 * D) and \
        writes_per_day(CKPT_13B, 1.0) > 1e16


@pytest.mark.parametrize("kwargs,match", [
    ({}, "TBW or as DWPD"),
    ({"tbw": 1.0, "dwpd": 1.0, "capacity_bytes": 1e12}, "not both"),
    ({"dwpd": 1.0}, "needs the drive's capacity"),
    ({"tbw": -5.0}, "must be positive"),
    ({"dwpd": 1.0, "capacity_bytes": 0.0}, "capacity = 0.0: must be positive"),
    ({"tbw": 1.0, "warranty_years": 0.0}, "warranty"),
])
def test_endurance_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        endurance(**kwargs)


def test_wear_share_must_be_a_fraction():
    for share in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="wear share"):
            wear_interval(1e9, ONE_DWPD, share)


def test_wear_sets_the_drive_interval_when_failures_would_write_too_much():
    common = dict(iteration_s=1.0, replicas=0, drive_bytes=CKPT_13B,
                  failures=Failures(8 * H, 1 * D, 30 * D))
    free = _levels(**common)
    worn = _levels(**common, budget=ONE_DWPD)
    assert free.drive.interval_s < 4095.0  # Daly alone: about 52 min
    assert worn.drive.limited_by == "wear" and worn.wear_interval_s == pytest.approx(4095.0)
    assert worn.drive.interval_s >= 4095.0 and worn.drive.every % worn.memory.every == 0
    assert worn.wear is not None and worn.wear.fraction_of_budget is not None
    assert 0.95 < worn.wear.fraction_of_budget <= 1.0
    assert worn.wear.bytes_per_day == pytest.approx(CKPT_13B * D / worn.drive.interval_s)
    assert worn.wear.per_iteration_bytes_per_day == pytest.approx(CKPT_13B * D)
    assert worn.waste > free.waste  # the budget costs work
    # with replicas, the drive only covers rare failures: failures set it, well within budget
    easy = _levels(iteration_s=1.0, drive_bytes=CKPT_13B, budget=ONE_DWPD)
    assert easy.drive.limited_by == "failures" and easy.wear is not None
    assert easy.wear.fraction_of_budget is not None and easy.wear.fraction_of_budget < 0.5
    assert easy.wear.lifetime_years == pytest.approx(
        5 / easy.wear.fraction_of_budget)


@pytest.mark.parametrize("kwargs,match", [
    ({"failures": Failures(-1.0, D, 30 * D)}, "process_mtbf_s = -1.0: .* must be positive"),
    ({"failures": Failures(0.0, D, 30 * D)}, "must be positive"),
    ({"memory": Tier(-1.0)}, "memory tier: checkpoint cost -1.0"),
    ({"drive": Tier(1.0, -2.0)}, "drive tier: .* restore -2.0"),
    ({"failures": Failures(8 * H, D)}, "no failures that only the drive recovers"),
    ({"failures": Failures(replica_loss_mtbf_s=30 * D), "replicas": 0},
     "no failures that the memory tier recovers"),
    ({"budget": ONE_DWPD}, "needs the checkpoint size"),
    ({"drive_bytes": -1.0}, "must be positive"),
    ({"replicas": -1}, "replicas=-1"),
    ({"iteration_s": 0.0}, "iteration time"),
])
def test_levels_reject_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _levels(**kwargs)


@pytest.mark.parametrize("text,nbytes", [("182GB", 182e9), ("182e9", 182e9), ("3.84 TB", 3.84e12),
                                         ("1.5TiB", 1.5 * 2**40), ("512mib", 512 * 2**20)])
def test_parse_size(text, nbytes):
    assert parse_size(text) == pytest.approx(nbytes)


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "5 XB", "inf"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


LEVEL_ARGS = ["advise", "--iteration-time", "1", "--checkpoint-size", "182GB",
              "--process-mtbf", "8h", "--node-mtbf", "1d", "--replica-loss-mtbf", "30d",
              "--memory-cost", "0.05", "--replica-cost", "0.2", "--drive-gbps", "3"]


def _without(args, *options):
    """``args`` less each of ``options`` and the value after it."""
    drop = {i + k for i, a in enumerate(args) if a in options for k in (0, 1)}
    return [a for i, a in enumerate(args) if i not in drop]


def test_cli_levels_text_and_json(capsys):
    assert cli.main([*LEVEL_ARGS, "--drive-dwpd", "1", "--drive-capacity", "3.84TB"]) == 0
    out = capsys.readouterr().out
    assert "memory_every = " in out and "drive_every = " in out
    assert "failures set the drive interval" in out and "15.7 PB/day" in out
    assert cli.main([*LEVEL_ARGS, "--replicas", "0", "--drive-dwpd", "1", "--drive-capacity",
                     "3.84TB"]) == 0
    assert "wear, not failures, sets the drive interval" in capsys.readouterr().out
    assert cli.main([*LEVEL_ARGS, "--nodes", "2", "--drives-per-node", "2", "--replicas", "2",
                     "--replica-gbps", "10", "--replica-cost", "0.3", "--json"]) == 2
    assert "give only one of --replica-cost, --replica-gbps" in capsys.readouterr().err
    args = _without(LEVEL_ARGS, "--replica-cost")
    assert cli.main([*args, "--nodes", "2", "--drives-per-node", "2", "--replicas", "2",
                     "--replica-gbps", "10", "--drive-tbw", "7000", "--write-amplification",
                     "1.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    node = 182e9 / 2
    assert data["drive"]["cost_s"] == pytest.approx(node / 2 / 3e9)
    assert data["memory"]["cost_s"] == pytest.approx(0.05 + 2 * node / 10e9)
    assert data["wear"]["bytes_per_checkpoint"] == pytest.approx(node / 2 * 1.5)
    assert data["wear"]["budget_bytes_per_day"] == pytest.approx(7000e12 / (5 * 365))
    expect = advise_levels(1.0, Tier(0.05), Tier(node / 2 / 3e9), Failures(8 * H, D, 30 * D),
                           replica=Tier(2 * node / 10e9), replicas=2,
                           drive_bytes=node / 2 * 1.5, budget=endurance(tbw=7000.0))
    assert data["memory"]["every"] == expect.memory.every
    assert data["drive"]["every"] == expect.drive.every
    # the tier from shares: (1 + replicas) x checkpoint / nodes, plus a manifest per share
    assert data["memory_tier_bytes_per_node"] == pytest.approx(3 * (node + (1 << 20)))


def test_cli_levels_size_the_memory_tier_from_shares(capsys):
    assert cli.main([*LEVEL_ARGS, "--nodes", "4", "--replicas", "1"]) == 0
    out = capsys.readouterr().out
    # 182 GB over 4 nodes: each keeps its ranks' shares (45.5 GB) and one replica's (45.5 GB)
    assert "memory tier per node: 91 GB = (1 + 1 replicas) x checkpoint / 4 node(s)" in out
    assert "tmpfs room for 2 steps: 182 GB" in out


@pytest.mark.parametrize("extra,match", [
    (["--wear-share", "0.5"], "--wear-share describes the drive's wear: give its endurance"),
    (["--drive-capacity", "3.84TB"], "--drive-capacity describes the drive's wear"),
    (["--drive-dwpd", "1"], "needs the drive's capacity"),
    (["--drive-dwpd", "1", "--drive-tbw", "100", "--drive-capacity", "1TB"], "not both"),
    (["--node-mtbf=-1h"], "bad duration '-1h': must be finite and >= 0"),
    (["--node-mtbf", "0"], "node_mtbf_s = 0.0: .* must be positive"),
    (["--cost", "3"], "--cost belongs to the one-level advice"),
    (["--cost", "3", "--mtbf", "1d"], "--cost, --mtbf belong to the one-level advice"),
    (["--drive-tbw", "100", "--wear-share", "2"], "wear share 2.0"),
    (["--nodes", "0"], "--nodes and --drives-per-node must be >= 1"),
    (["--params", "13e9"], "--checkpoint-size or --params, not both"),
    (["--write-amplification", "0.5", "--drive-tbw", "100"], "--write-amplification 0.5"),
])
def test_cli_levels_bad_input_exits_2_with_the_reason(extra, match, capsys):
    assert cli.main([*LEVEL_ARGS, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(match, captured.err), captured.err


def test_cli_levels_needs_what_it_counts_and_costs(capsys):
    assert cli.main(_without(LEVEL_ARGS, "--iteration-time")) == 2
    assert "give --iteration-time" in capsys.readouterr().err
    no_size = _without(LEVEL_ARGS, "--checkpoint-size", "--drive-gbps")
    assert cli.main([*no_size, "--drive-gbps", "3"]) == 2
    assert ("give --drive-cost (its measured stall), or --drive-gbps or --measure-drive with "
            "--checkpoint-size") in capsys.readouterr().err
    assert cli.main([*no_size, "--drive-cost", "60", "--drive-tbw", "100"]) == 2
    assert "endurance needs --checkpoint-size" in capsys.readouterr().err
    assert cli.main([*no_size, "--drive-cost", "60"]) == 0  # no size: no wear report
    assert "drive writes" not in capsys.readouterr().out
    assert cli.main(["advise", "--cost", "3"]) == 2
    assert "give --mtbf (one level)" in capsys.readouterr().err


@pytest.mark.parametrize("heading", ["## Choosing memory_every and drive_every",
                                     "## Choosing every level's interval"])
def test_the_docs_example_is_what_advise_prints(heading, capsys):
    """docs/TRAINING.md's examples of the two-level advice and of every level's interval: the
    command and its output, verbatim."""
    argv, printed = doc_command("docs/TRAINING.md", heading, "iteration ")
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == printed


def test_cli_levels_measures_a_tier_write_rate(tmp_path, capsys):
    write_rate.forget()
    args = [*_without(LEVEL_ARGS, "--drive-gbps"), "--nodes", "2", "--drives-per-node", "2",
            "--measure-drive", str(tmp_path)]
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gbps = data["measured_gbps"]["drive"]
    assert gbps > 0 and list(data["measured_gbps"]) == ["drive"]
    assert data["drive"]["cost_s"] == pytest.approx(182e9 / 4 / (gbps * 1e9))
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert cli.main(args) == 0
    assert f"measured: {tmp_path} takes" in capsys.readouterr().out
    assert cli.main([*args, "--drive-gbps", "3"]) == 2
    assert "give only one of --drive-gbps, --measure-drive" in capsys.readouterr().err
    missing = str(tmp_path / "absent")
    assert cli.main([*_without(args, "--measure-drive"), "--measure-drive", missing]) == 2
    assert f"cannot measure the write rate into {missing}" in capsys.readouterr().err


def test_one_level_advice_respects_the_drive_endurance():
    plain = advise(60.0, D, iteration_s=1.0)
    assert plain.limited_by == "failures" and plain.wear is None
    assert plain.optimal.interval_s == pytest.approx(daly_interval(60.0, D))
    worn = advise(60.0, D, iteration_s=1.0, drive_bytes=CKPT_13B, budget=ONE_DWPD)
    assert worn.limited_by == "wear" and worn.daly_interval_s == pytest.approx(
        daly_interval(60.0, D))
    assert worn.optimal.interval_s == pytest.approx(CKPT_13B * D / 3.84e12)  # 4095 s
    assert worn.wear is not None and worn.wear.fraction_of_budget == pytest.approx(1.0)
    assert worn.optimal.waste > plain.optimal.waste
    rare = advise(60.0, 10 * D, drive_bytes=CKPT_13B, budget=ONE_DWPD)
    assert rare.limited_by == "failures" and rare.wear is not None
    assert rare.wear.fraction_of_budget is not None and rare.wear.fraction_of_budget < 1.0
    sized = advise(60.0, D, drive_bytes=CKPT_13B)  # writes per day, no rating to compare with
    assert sized.wear is not None and sized.wear.fraction_of_budget is None
    assert sized.optimal.interval_s == plain.optimal.interval_s
    with pytest.raises(ValueError, match="needs the checkpoint size"):
        advise(60.0, D, budget=ONE_DWPD)


def test_cli_one_level_with_wear(capsys):
    args = ["advise", "--cost", "60", "--mtbf", "1d", "--iteration-time", "1", "--params",
            "13e9", "--drive-dwpd", "1", "--drive-capacity", "3.84TB"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "Wear-limited interval:     1.14 h (4095 s)" in out
    assert "15.7 PB/day, 4,095x the endurance budget" in out
    assert "wear, not failures, sets the drive interval" in out
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["limited_by"] == "wear" and data["wear"]["bytes_per_checkpoint"] == CKPT_13B
    assert cli.main(_without(args, "--drive-capacity")) == 2
    assert "needs the drive's capacity" in capsys.readouterr().err
    assert cli.main(["advise", "--cost", "60", "--mtbf", "1d", "--drive-tbw", "100"]) == 2
    assert "endurance needs --checkpoint-size" in capsys.readouterr().err


def test_cli_one_level_rejects_the_two_level_options(capsys):
    for extra in (["--drive-cost", "5"], ["--replicas", "2"], ["--restore-memory", "10"],
                  ["--measure-drive", "/tmp"]):
        assert cli.main(["advise", "--cost", "3", "--mtbf", "1d", *extra]) == 2
        assert f"{extra[0]} belongs to the two-level advice" in capsys.readouterr().err
    assert cli.main(["advise", "--cost", "3", "--mtbf", "1d", "--drive-cost", "5",
                     "--replicas", "2"]) == 2
    assert "--replicas, --drive-cost belong to the two-level" in capsys.readouterr().err
