"""Every level's interval (``gds-persist advise --level ... --durable ...``): node-local levels,
nearest first, then the durable level; Young/Daly per level, nested, within the drives' endurance
and the durable level's flush time."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest

from gds_persist import cli
from gds_persist.advice.interval import daly_interval, lost_work
from gds_persist.advice.levels import Failures, Tier, advise_levels
from gds_persist.advice.multilevel import Level, LevelFailures, advise_multilevel
from gds_persist.advice.wear import endurance, wear_interval

H, D = 3600.0, 86400.0
ONE_DWPD = endurance(dwpd=1.0, capacity_bytes=3.84e12)
SHARE = 2 * 182e9 / 8  # a 13B model's node share on 8 nodes, with 1 copy of another node's
TMPFS = Level("tmpfs", 0.2, 20.0, "memory", 1)
NVME = Level("nvme", 0.5, 60.0, "drive", 1, bytes_per_drive=SHARE)
DURABLE = Level("durable", 30.0, 600.0, "store", durable=True)
FAILURES = LevelFailures(6 * H, 1 * D, 3 * D, 30 * D)


def _advise(levels=(TMPFS, NVME, DURABLE), failures=FAILURES, iteration_s=1e-3, **kw):
    return advise_multilevel(iteration_s, list(levels), failures, **kw)


def test_each_level_gets_the_closed_form_first_order_optimum():
    a = _advise()
    m = {"tmpfs": 1 / (1 / (6 * H) + 1 / D), "nvme": 3 * D, "durable": 30 * D}
    stall = {"tmpfs": 0.2, "nvme": 0.5, "durable": 30.0}
    restore = {"tmpfs": 20.0, "nvme": 60.0, "durable": 600.0}
    assert [r.recovers for r in a.levels] == [["process", "node"], ["reboot"], ["replica_loss"]]
    for r in a.levels:
        young = math.sqrt(2 * stall[r.name] * m[r.name])
        assert r.mtbf_s == pytest.approx(m[r.name])
        assert r.young_interval_s == pytest.approx(young)
        # C << M and short iterations: Daly and whole iterations move it < 1%; nesting (a
        # whole multiple of the nearer level's) a little more, where the total wastes least
        assert r.interval_s == pytest.approx(young, rel=0.02), r
        assert r.limited_by == "failures"
    assert a.levels[1].every % a.levels[0].every == 0
    assert a.levels[2].every % a.levels[1].every == 0
    closed = sum(math.sqrt(2 * stall[n] / m[n]) + restore[n] / m[n] for n in m)
    assert a.first_order_waste == pytest.approx(closed)
    assert a.waste == pytest.approx(closed, rel=0.005)
    assert a.waste == pytest.approx(sum(r.waste for r in a.levels))


def test_two_levels_agree_with_the_two_level_advice():
    """tmpfs with a copy + a durable drive is memory_every + drive_every."""
    durable = Level("drive", 60.0, 300.0, "drive", durable=True)
    a = _advise([Level("tmpfs", 0.25, 5.0, "memory", 1), durable],
                LevelFailures(8 * H, D, replica_loss_mtbf_s=30 * D))
    b = advise_levels(1e-3, Tier(0.25, 5.0), Tier(60.0, 300.0), Failures(8 * H, D, 30 * D),
                      replica=Tier(0.0, 5.0))
    assert a.levels[0].interval_s == pytest.approx(b.memory.interval_s, rel=0.01)
    assert a.levels[1].interval_s == pytest.approx(b.drive.interval_s, rel=0.01)
    assert a.waste == pytest.approx(b.waste, rel=0.01)


def test_the_wear_floor_binds_only_when_failures_would_write_too_much():
    free = _advise(iteration_s=1.0)
    worn = _advise(iteration_s=1.0, budget=ONE_DWPD)
    nvme = worn.levels[1]
    floor = SHARE * D / 3.84e12  # 1024 s: the whole budget, the one drive-backed level
    assert free.levels[1].interval_s < floor and free.levels[1].wear_floor_s is None
    assert free.levels[1].wear is not None and free.levels[1].wear.fraction_of_budget is None
    assert nvme.limited_by == "wear" and nvme.wear_floor_s == pytest.approx(floor)
    assert nvme.interval_s >= floor and "wear floor" in nvme.why
    assert nvme.wear is not None and nvme.wear.fraction_of_budget is not None
    assert 0.9 < nvme.wear.fraction_of_budget <= 1.0
    assert worn.waste > free.waste
    assert worn.levels[0].wear is None and worn.levels[0].wear_floor_s is None  # tmpfs: no wear
    # a drive rated 10x: failures set it, as without a rating
    roomy = _advise(iteration_s=1.0, budget=endurance(dwpd=10.0, capacity_bytes=3.84e12))
    assert roomy.levels[1].limited_by == "failures"
    assert roomy.levels[1].every == free.levels[1].every
    # two drive-backed levels share one budget: each gets half, the floor doubles
    drive_root = Level("durable", 30.0, 600.0, "drive", durable=True, bytes_per_drive=SHARE)
    both = _advise([TMPFS, NVME, drive_root], iteration_s=1.0, budget=ONE_DWPD)
    assert both.levels[1].wear_floor_s == pytest.approx(2 * floor)
    total = sum(r.wear.bytes_per_day for r in both.levels if r.wear is not None)
    assert total <= 3.84e12


def test_a_level_without_copies_does_not_claim_node_failures():
    alone = Level("tmpfs", 0.2, 20.0, "memory", 0)
    a = _advise([alone, NVME, DURABLE])
    assert a.levels[0].recovers == ["process"]
    assert a.recovered_from["node"] == "nvme"  # the nearest level with a copy
    assert a.levels[1].recovers == ["node", "reboot"]
    b = _advise([alone, Level("nvme", 0.5, 60.0, "drive", 0), DURABLE])
    assert b.recovered_from == {"process": "tmpfs", "node": "durable", "reboot": "nvme",
                                "replica_loss": "durable"}
    assert b.levels[2].mtbf_s == pytest.approx(1 / (1 / D + 1 / (30 * D)))
    # memory does not survive a reboot, a drive does; the durable level recovers all
    c = _advise([TMPFS, DURABLE])
    assert c.recovered_from["reboot"] == "durable"


def test_a_level_with_no_failures_of_its_own_goes_with_the_next():
    a = _advise(failures=LevelFailures(6 * H, D, replica_loss_mtbf_s=30 * D))  # no reboots
    nvme, durable = a.levels[1], a.levels[2]
    assert nvme.recovers == [] and nvme.mtbf_s is None
    assert nvme.limited_by == "none_of_its_own" and nvme.every == durable.every
    assert durable.every % a.levels[0].every == 0 and durable.limited_by == "failures"


def test_a_nearer_level_is_never_sparser_than_a_farther_one():
    dear = Level("tmpfs", 50.0, 20.0, "memory", 1)
    a = _advise([dear, Level("nvme", 0.01, 60.0, "drive", 1), DURABLE], iteration_s=1.0)
    assert a.levels[0].every == a.levels[1].every
    assert a.levels[0].limited_by == "farther" and "no sparser than nvme" in a.levels[0].why


@pytest.mark.parametrize("flush", [0.0, 1.0, 7 * 60.0, 5 * H])
@pytest.mark.parametrize("stall", [0.0, 30.0])
def test_the_durable_interval_is_never_below_the_flush_time(flush, stall):
    durable = Level("durable", stall, 600.0, "store", durable=True, flush_s=flush)
    a = _advise([TMPFS, NVME, durable], iteration_s=0.7)
    r = a.levels[-1]
    assert r.interval_s >= flush and r.flush_s == flush
    if flush > (daly_interval(stall, 30 * D) if stall else 0.0):
        assert r.limited_by == "flush" and "flush-time floor" in r.why
    # a step counts as durable only once flushed: the flush joins the work redone
    assert a.lost_per_failure_s["replica_loss"] == pytest.approx(
        lost_work(r.interval_s, stall, 30 * D, 600.0 + flush))


def test_random_levels_keep_nesting_floors_and_budgets(test_seed):
    rng = random.Random(test_seed)
    for _ in range(200):
        local = [Level(f"l{i}", rng.choice([0.0, rng.uniform(0, 5)]), rng.uniform(0, 100),
                       rng.choice(["memory", "drive"]), rng.randint(0, 2),
                       bytes_per_drive=rng.uniform(1e9, 1e11))
                 for i in range(rng.randint(0, 3))]
        local = [lv if lv.kind == "drive" else Level(lv.name, lv.stall_s, lv.restore_s,
                                                     "memory", lv.copies) for lv in local]
        durable = Level("root", rng.uniform(0, 60), 600.0, rng.choice(["store", "drive"]),
                        durable=True, flush_s=rng.uniform(0, 3 * H), bytes_per_drive=1e10)
        if durable.kind == "store":
            durable = Level("root", durable.stall_s, 600.0, "store", durable=True,
                            flush_s=durable.flush_s)
        iteration = rng.uniform(0.05, 30)
        failures = LevelFailures(*(rng.choice([math.inf, rng.uniform(H, 30 * D)])
                                   for _ in range(3)), rng.uniform(D, 60 * D))
        a = advise_multilevel(iteration, [*local, durable], failures, budget=ONE_DWPD)
        every = [r.every for r in a.levels]
        assert all(b % p == 0 for p, b in itertools.pairwise(every)), every
        assert a.levels[-1].interval_s >= durable.flush_s
        written = sum(r.wear.bytes_per_day for r in a.levels if r.wear is not None)
        assert written <= ONE_DWPD.bytes_per_day * (1 + 1e-9), a  # the drive's one budget
        for r in a.levels:
            assert r.interval_s == r.every * iteration and r.every >= 1
            if r.wear_floor_s is not None:
                assert r.interval_s >= r.wear_floor_s * (1 - 1e-9)


@pytest.mark.parametrize("levels,kw,match", [
    ([TMPFS, NVME], {}, "end with the one durable level"),
    ([DURABLE, TMPFS], {}, "end with the one durable level"),
    ([TMPFS, DURABLE, DURABLE], {}, "end with the one durable level"),
    ([Level("x", -1.0, 0.0), DURABLE], {}, "level 'x': stall -1.0 s must be finite and >= 0"),
    ([Level("x", 1.0, 0.0, "ssd"), DURABLE], {}, "unknown kind 'ssd'; use one of memory, drive"),
    ([Level("x", 1.0, 0.0, "store"), DURABLE], {}, "give it as the durable level"),
    ([Level("d", 1.0, durable=True, kind="tape")], {}, "unknown kind 'tape'; use one of store"),
    ([Level("x", 1.0, 0.0, copies=-1), DURABLE], {}, "copies -1 must be a whole number"),
    ([Level("x", 1.0, 0.0, flush_s=5.0), DURABLE], {}, "only the durable level has a flush"),
    ([Level("durable", 1.0), DURABLE], {}, "distinct, non-empty name"),
    ([Level("nvme", 1.0, kind="drive"), DURABLE], {"budget": ONE_DWPD}, "needs the bytes"),
    ([TMPFS, DURABLE], {"failures": LevelFailures(6 * H, D)}, "only the durable level recovers"),
    ([TMPFS, DURABLE], {"failures": LevelFailures(-1.0, D, D, D)}, "must be positive"),
    ([TMPFS, DURABLE], {"iteration_s": 0.0}, "iteration time"),
    ([TMPFS, DURABLE], {"wear_share": 1.5}, "wear share"),
])
def test_bad_levels_are_refused_naming_the_fix(levels, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        _advise(levels, **kw)
    assert "docs/TRAINING.md, \"Choosing every level's interval\"" in str(e.value)


ARGS = ["advise", "--iteration-time", "1", "--params", "13e9", "--nodes", "8",
        "--process-mtbf", "6h", "--node-mtbf", "1d", "--reboot-mtbf", "3d",
        "--replica-loss-mtbf", "30d", "--level", "tmpfs:0.2:20s", "--level",
        "nvme:0.5:1m:drive:1", "--durable", "0:10m:30m"]


def test_cli_levels_text_and_json(capsys):
    assert cli.main([*ARGS, "--drive-dwpd", "1", "--drive-capacity", "3.84TB"]) == 0
    out = capsys.readouterr().out
    for line in ("tmpfs (memory, 1 copy): every ", "why: failures: Daly's optimum",
                 "why: wear floor", "why: flush-time floor: a flush takes 30 min",
                 "per node, one step: tmpfs 45.5 GB, nvme 45.5 GB"):
        assert line in out, out
    assert cli.main([*ARGS, "--drive-tbw", "7000", "--write-amplification", "1.5",
                     "--drives-per-node", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in data["levels"]] == ["tmpfs", "nvme", "durable"]
    nvme = data["levels"][1]
    assert nvme["wear"]["bytes_per_checkpoint"] == pytest.approx(SHARE / 2 * 1.5)
    assert nvme["wear_floor_s"] == pytest.approx(wear_interval(SHARE / 2 * 1.5,
                                                               endurance(tbw=7000.0)))
    expect = advise_multilevel(1.0, [TMPFS, Level("nvme", 0.5, 60.0, "drive", 1,
                                                  bytes_per_drive=SHARE / 2 * 1.5),
                                     Level("durable", 0.0, 600.0, "store", durable=True,
                                           flush_s=1800.0)],
                               FAILURES, budget=endurance(tbw=7000.0))
    assert [r["every"] for r in data["levels"]] == [r.every for r in expect.levels]
    assert [r["limited_by"] for r in data["levels"]] == [r.limited_by for r in expect.levels]
    assert data["levels"][2]["every"] * 1.0 >= 1800.0
    assert data["bytes_per_node"]["nvme"] == pytest.approx(SHARE + 2 * (1 << 20))


@pytest.mark.parametrize("change,match", [
    ({"--level": "tmpfs:-1:20s"}, r"--level 'tmpfs:-1:20s': stall: bad duration '-1'"),
    ({"--level": "tmpfs:0.2:20s:ssd"}, "unknown kind 'ssd'; use one of memory, drive"),
    ({"--level": "tmpfs:0.2"}, r"write NAME:STALL:RESTORE\[:KIND\[:COPIES\]\], e.g."),
    ({"--level": "tmpfs:0.2:1s:memory:two"}, "copies 'two' must be a whole number"),
    ({"--level": "s3:0:1s:store"}, "kind 'store' is the durable level's"),
    ({"--durable": "0:10m"}, r"write STALL:RESTORE:FLUSH\[:KIND\], e.g. --durable 0:10m:30m"),
    ({"--durable": "0:10m:30m:tape"}, "the durable level: unknown kind 'tape'"),
    ({"--durable": None}, "give the durable level last: --durable"),
    ({"--iteration-time": None}, "give --iteration-time"),
    ({"--replica-loss-mtbf": None}, "no failure that only the durable level recovers"),
    ({"--memory-cost": "0.1"}, "--memory-cost belongs to the one- or two-level advice"),
    ({"--mtbf": "1d", "--replicas": "1"}, "--mtbf, --replicas belong"),
])
def test_cli_levels_bad_input_exits_2_naming_the_fix(change, match, capsys):
    args = list(ARGS)
    for flag, value in change.items():
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
        if value is not None:
            args += [flag, value]
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and re.search(match, captured.err), captured.err


def test_reboot_mtbf_needs_the_levels(capsys):
    assert cli.main(["advise", "--cost", "3", "--mtbf", "1d", "--reboot-mtbf", "3d"]) == 2
    assert "--reboot-mtbf belongs to the advice per level" in capsys.readouterr().err

