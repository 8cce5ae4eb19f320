"""Smoke test of bench/deepspeed_suite.py's pure parts: its arguments, the outcome table it
compares and reports, the resume after a hung test, the test patches. Needs no DeepSpeed
checkout (nor DeepSpeed: the module imports it only to attach)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import deepspeed_suite as suite

A = "unit/checkpoint/test_a.py::TestA::test_a"
B = "unit/checkpoint/test_b.py::TestB::test_b[1]"
C = "unit/checkpoint/test_c.py::TestC::test_c"
D = "unit/checkpoint/test_d.py::TestD::test_d"
E = "unit/checkpoint/test_e.py::TestE::test_e"
F = "unit/checkpoint/test_f.py::TestF::test_f"


def _r(nodeid: str, outcome: str, error: str = "", attached: int = 0) -> dict[str, object]:
    return {"nodeid": nodeid, "outcome": outcome, "error": error, "attached": attached,
            "attach_errors": [], "gds_persist": ["/x/gds_persist"] if attached else []}


def _table() -> tuple[dict[str, dict[str, object]], dict[str, dict[str, object]]]:
    stock = {A: _r(A, "passed"), B: _r(B, "passed"), C: _r(C, "failed", "KeyError: 'x'"),
             D: _r(D, "skipped", "Skipped: CPU Accelerator does not support this test"),
             E: _r(E, "passed"), F: _r(F, "failed", "ValueError: stock")}
    ours = {A: _r(A, "passed", attached=2),
            B: _r(B, "failed", "AssertionError: [at common.py:27 f: assert x]", attached=4),
            C: _r(C, "failed", "KeyError: 'x'", attached=2),
            D: _r(D, "skipped", "Skipped: CPU Accelerator does not support this test"),
            E: _r(E, suite.HUNG, "pytest.exit: Test hanged, exiting", attached=2),
            F: _r(F, "passed", attached=0)}
    return stock, ours


def test_arguments_default_to_the_pinned_revision_outside_the_repo():
    args = suite.arguments(["--deepspeed-git", "/x/DeepSpeed"])
    assert args.rev == suite.DEFAULT_REV and len(suite.DEFAULT_REV) == 40
    assert suite.REPO not in args.work.resolve().parents
    assert (args.runs, args.keyword, args.gds_persist_rev, args.out) == ("both", None, None, None)
    assert suite.arguments(["--report-only"]).report_only


@pytest.mark.parametrize("argv", [[], ["--deepspeed-git", "/x", "--work", str(suite.REPO)],
                                  ["--deepspeed-git", "/x", "--work", str(suite.REPO / "w")],
                                  ["--deepspeed-git", "/x", "--runs", "neither"]])
def test_arguments_refused(argv, capsys):
    with pytest.raises(SystemExit):
        suite.arguments(argv)
    assert "error:" in capsys.readouterr().err


def test_selection_and_not_run_are_disjoint_and_each_not_run_says_why():
    assert not set(suite.SELECTION) & set(suite.NOT_RUN)
    assert all(reason.strip() for reason in suite.NOT_RUN.values())
    assert all(p.startswith(suite.CKPT + "/") for p in (*suite.SELECTION, *suite.NOT_RUN))


def test_differences_count_only_tests_that_passed_stock():
    stock, ours = _table()
    kinds = suite.differences(stock, ours)
    assert kinds["extra"] == [B, E]  # failed and hung attached; C failed both ways: not counted
    assert kinds["fixed"] == [F]
    assert kinds["other"] == []
    assert kinds["unattached"] == [F]  # ran attached, no engine attached; D was skipped


def test_report_lists_both_outcomes_the_extra_failures_and_counts():
    stock, ours = _table()
    text = "\n".join(suite.report(stock, ours, ["header line"]))
    assert text.startswith("header line\n")
    assert f"passed           failed                 4  {B}" in text
    assert "extra failure: AssertionError: [at common.py:27 f: assert x]" in text
    assert "stock: KeyError: 'x'" in text and "stock: Skipped: CPU Accelerator" in text
    assert "passed stock: 3; of these passed attached: 1" in text
    assert "extra failures (passed stock, failed attached): 2" in text
    assert f"  {E}  -- pytest.exit: Test hanged, exiting" in text
    assert "ran attached with no engine attached: 1" in text
    assert "attached engines' gds_persist from: /x/gds_persist" in text
    assert "  stock    6: 2 failed, 3 passed, 1 skipped" in text


def test_a_test_run_only_one_way_is_another_change_not_a_failure():
    stock, ours = _table()
    del ours[A]
    kinds = suite.differences(stock, ours)
    assert A in kinds["other"] and A not in kinds["extra"]
    assert f"passed           not run                -  {A}" in suite.report(stock, ours, [])


def test_remaining_resumes_only_after_a_hung_test():
    collected = [A, B, C, D]
    assert suite.remaining(collected, {A: _r(A, "passed"), B: _r(B, "failed")}) == []
    assert suite.remaining(collected, {A: _r(A, "passed"), B: _r(B, suite.HUNG)}) == [C, D]


def test_records_round_trip(tmp_path):
    path = tmp_path / "r.jsonl"
    assert suite.read_records(path) == {}
    path.write_text('{"nodeid": "a", "outcome": "passed"}\n{"nodeid": "b", "outcome": "hung"}\n')
    assert suite.read_records(path) == {"a": {"nodeid": "a", "outcome": "passed"},
                                        "b": {"nodeid": "b", "outcome": "hung"}}


class RemoteTraceback(Exception):  # the name multiprocessing.pool gives the worker's traceback
    pass


def test_worker_frame_names_where_a_worker_raised():
    error = AssertionError()
    error.__cause__ = RemoteTraceback('\n"""\nTraceback (most recent call last):\n'
                                      '  File "/w/pool.py", line 125, in worker\n'
                                      "    result = (True, func(*args, **kwds))\n"
                                      '  File "/w/unit/checkpoint/common.py", line 27, in cmp\n'
                                      "    assert a == b\nAssertionError\n" '"""')
    assert suite._worker_frame(error) == " [at common.py:27 cmp: assert a == b]"
    assert suite._worker_frame(ValueError("local")) == ""


def test_first_line():
    assert suite._first_line("\n  KeyError: 'x'\n  more\n") == "KeyError: 'x'"
    assert suite._first_line("") == ""
    assert suite._first_line("x" * 300) == "x" * 197 + "..."


def test_patch_tests_applies_each_patch_once(tmp_path: Path):
    for name, text, _, _ in suite.TEST_PATCHES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("def f():\n" + text + "    pass\n")
    lines = suite.patch_tests(tmp_path)
    assert len(lines) == len(suite.TEST_PATCHES) and "not needed" not in " ".join(lines)
    for name, _, replacement, _ in suite.TEST_PATCHES:
        assert (tmp_path / name).read_text() == "def f():\n" + replacement + "    pass\n"
    assert all("not needed here" in line for line in suite.patch_tests(tmp_path))


def test_suite_env_puts_the_tested_gds_persist_first(tmp_path: Path):
    env = suite.suite_env(tmp_path, "attached", "gds_persist", first=tmp_path / "g")
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "g"), str(suite.REPO)]
    assert env[suite.ENGINE_ENV] == "gds_persist" and env["DS_ACCELERATOR"] == "cpu"
    assert env[suite.RECORD_ENV] == str(tmp_path / "attached.jsonl")
