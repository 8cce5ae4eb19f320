"""DeepSpeed's own checkpoint tests, run twice: stock, and with
``gds_persist.integrations.deepspeed.attach`` applied (with its defaults) to every engine.

    python bench/deepspeed_suite.py --deepspeed-git DIR [--rev REV] [--work DIR] [--out FILE]
        [--gds-persist-rev REV] [-k EXPR] [--runs both|stock|attached] [--report-only]

1. DeepSpeed's test sources are not in its wheel (nor its sdist): they come from a git clone of
   deepspeedai/DeepSpeed (a bare one is fine) at :data:`DEFAULT_REV` unless ``--rev`` says
   otherwise (the revision and its ``version.txt`` are printed; :data:`TEST_PATCHES`, printed
   too, fit its tests to the installed release's API). ``tests/conftest.py``,
   ``tests/pytest.ini`` (DeepSpeed's pytest settings) and ``tests/unit`` minus its many
   unrelated subpackages (:data:`EXTRACT`: ``unit/checkpoint`` and the modules it imports) are
   extracted into ``WORK/deepspeed-REV`` anew each run, never into this repository. Nothing
   named ``deepspeed`` is extracted, so the tests import the installed DeepSpeed
   (``tests/conftest.py`` puts the tree's root first on ``sys.path``).
2. The tests import nothing beyond DeepSpeed, torch, numpy and pytest, so they run with this
   interpreter (no venv of their own).
3. pytest runs :data:`SELECTION` twice, from ``WORK/deepspeed-REV/tests`` with
   ``-c pytest.ini`` (DeepSpeed's settings, not ours), with this module as a plugin
   (``-p bench.deepspeed_suite``) that records each test's outcome and error.
   ``DistributedTest`` runs a test's body in worker processes forked from a ``forkserver``;
   the plugin adds this module to that server's preloads (both runs, so both start alike), and
   in the second run (``GDS_PERSIST_SUITE_ENGINE=gds_persist``) importing it wraps the
   ``__init__`` of ``DeepSpeedEngine`` and of each subclass so that, when the outermost one
   returns, ``attach(engine)`` is applied: every engine ``deepspeed.initialize`` (or anything
   else) builds, in any process, writes and reads through gds_persist. Each attach appends a
   line to a log; the plugin counts the lines per test, and the report names every test that
   ran attached with no engine attached.
4. It prints every test's two outcomes (and the engines attached, over all ranks), and for
   each extra failure (passed stock, failed attached) the first line of the error and, for an
   error raised in a worker, the worker's failing line; counts at the end. A test that fails
   stock is listed but not counted as a difference.

``--gds-persist-rev REV`` tests gds_persist as committed at REV (``git archive`` into WORK,
first on PYTHONPATH) instead of the working tree; the report names where the attached engines'
gds_persist came from.

The environment (:func:`suite_env`): ``DS_ACCELERATOR=cpu`` (gloo); ``LOCAL_SIZE=4``, the
number of CPU "devices" the CPU accelerator reports (else one per NUMA node, and every test
with ``world_size`` 2 or 4 skips); ``DS_UNITTEST_TIMEOUT`` per test (DeepSpeed's harness then
ends the whole pytest run: the plugin records the test as hung and the run resumes after it);
``OMP_NUM_THREADS=1``. The first run on a machine JIT-compiles DeepSpeed's shm comm op (about
a minute, cached in ``~/.cache/torch_extensions``).

Not run (:data:`NOT_RUN`, with reasons, printed). Fails both ways here: the ten tests taking
a ``DistributedFixture`` (FixtureLookupError under pytest 9). On the 2-core VM: about 400 s
stock, 470 s attached. Not handled: a worker stuck so that DeepSpeed's pool teardown itself
hangs stalls the run.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.suites import read_records, run_or_report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# deepspeedai/DeepSpeed master of 2026-08-22 ("Fix ZeRO-1/2 with zero-sized parameters
# (#8280)"), version.txt 0.19.6: the newest revision in the mirror; it has no 0.19.7 or 0.19.8
# (the installed release) revision, and the 0.19.8 sdist has no tests.
DEFAULT_REV = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
EXTRACT = ("tests/conftest.py", "tests/pytest.ini", "tests/unit/__init__.py",
           "tests/unit/common.py", "tests/unit/simple_model.py", "tests/unit/util.py",
           "tests/unit/checkpoint")
CKPT = "unit/checkpoint"
# latest, tags, shared weights, ZeRO 0-3 (incl. frozen weights, elastic, edge cases), zero_to_fp32
SELECTION = tuple(f"{CKPT}/{name}" for name in (
    "test_latest_checkpoint.py", "test_tag_validation.py", "test_shared_weights.py",
    "test_zero_optimizer.py", "test_convert_checkpoint.py"))
NOT_RUN = {
    f"{CKPT}/test_universal_checkpoint.py": "144 ZeRO x dtype x world-size cases: over an hour "
                                            "a run on 2 cores",
    f"{CKPT}/test_autotp_uc_checkpoint.py": "AutoTP universal conversion: 30 of 37 cases build "
                                            "no engine; the rest need tensor parallelism x4",
    f"{CKPT}/test_lr_scheduler.py": "LR scheduler state, the ZeRO tests' checkpoints again: "
                                    "time",
    f"{CKPT}/test_other_optimizer.py": "FusedLamb / fused Adam with fp16: CUDA kernels",
    f"{CKPT}/test_moe_checkpoint.py": "MoE with fp16 on 4+ ranks: time",
    f"{CKPT}/test_pipeline.py": "pipeline engine on 4 ranks: time",
    f"{CKPT}/test_reshape_checkpoint.py": "pipeline topology reshaping: builds no engine",
    f"{CKPT}/test_sparse.py": "tests sparse_gradients and sparse_tensor_module_names, which "
                              "0.19.8 removed (DeepSpeed #8504)",
    f"{CKPT}/test_mics_optimizer.py": "MiCS: CUDA only",
}
# (file, text, replacement, why): the revision's tests against the installed 0.19.8's API
TEST_PATCHES = (
    ("tests/unit/checkpoint/common.py",
     "    assert saved_model.sparse_tensor_module_names == "
     "loaded_model.sparse_tensor_module_names\n",
     "", "0.19.8 dropped the engine's sparse_tensor_module_names (DeepSpeed #8504, after this "
     "revision): else every checkpoint_correctness_verification test fails stock"),
)
ENGINE_ENV = "GDS_PERSIST_SUITE_ENGINE"  # "gds_persist": attach every engine
RECORD_ENV = "GDS_PERSIST_SUITE_RECORD"  # the JSON-lines file the plugin appends a test to
ATTACH_ENV = "GDS_PERSIST_SUITE_ATTACHED"  # the file every attach (any process) appends to
COLLECTED_ENV = "GDS_PERSIST_SUITE_COLLECTED"  # the node ids pytest collected
TEST_TIMEOUT_S = 300  # DS_UNITTEST_TIMEOUT: a test's workers past it count as hung
HUNG = "hung"


# ---------------------------------------------------------------- attach every engine

_building: dict[int, int] = {}  # id(engine) -> how many engine __init__s are on its stack


def install_attach() -> None:
    """Wrap the ``__init__`` of DeepSpeedEngine and of every subclass (PipelineEngine,
    DeepSpeedHybridEngine) so the outermost one ends by attaching the engine; idempotent."""
    import deepspeed.runtime.hybrid_engine  # noqa: F401  (defines a subclass)
    import deepspeed.runtime.pipe.engine  # noqa: F401
    from deepspeed.runtime.engine import DeepSpeedEngine

    for cls in (DeepSpeedEngine, *_subclasses(DeepSpeedEngine)):
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_gds_suite", False):
            cls.__init__ = _attaching(init)  # type: ignore[method-assign]


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def _attaching(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        _building[key] = _building.get(key, 0) + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _building[key] -= 1
            outermost = _building[key] == 0
            if outermost:
                del _building[key]
        if outermost:
            _attach(self)

    __init__._gds_suite = True  # type: ignore[attr-defined]
    return __init__


def _attach(engine: Any) -> None:
    import gds_persist
    from gds_persist.integrations.deepspeed import attach

    entry: dict[str, Any] = {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")),
                             "engine": type(engine).__name__,
                             "from": os.path.dirname(gds_persist.__file__)}
    try:
        entry["split_reason"] = attach(engine).split_reason
    except BaseException as e:
        entry["error"] = _first_line(f"{type(e).__name__}: {e}")
        raise
    finally:
        with open(os.environ[ATTACH_ENV], "a") as f:
            f.write(json.dumps(entry) + "\n")


if os.environ.get(ENGINE_ENV) == "gds_persist":  # the pytest process and the forkserver
    install_attach()


# ---------------------------------------------------------------- the pytest plugin

def pytest_configure(config: Any) -> None:
    """DistributedTest forks its workers from a forkserver: preloading this module there
    installs the wrapper in every worker; DeepSpeed is preloaded in both runs alike (imported
    once, not per worker)."""
    multiprocessing.set_forkserver_preload(["__main__", "deepspeed", __name__])


def pytest_collection_finish(session: Any) -> None:
    with open(os.environ[COLLECTED_ENV], "w") as f:
        f.write("".join(item.nodeid + "\n" for item in session.items))


_records: dict[str, dict[str, Any]] = {}
_attach_mark: dict[str, int] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Before setup: a DistributedFixture builds its engines in the setup phase."""
    _attach_mark[nodeid] = len(_attach_lines())
    _records[nodeid] = {"nodeid": nodeid, "outcome": "passed"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: Any) -> Generator[None, Any, Any]:
    try:
        return (yield)
    except pytest.exit.Exception as e:  # DeepSpeed's harness: "Test hanged, exiting"
        _records[item.nodeid].update(outcome=HUNG, error=_first_line(f"pytest.exit: {e}"))
        _write(item.nodeid)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Generator[None, Any, Any]:
    report = yield
    record = _records[item.nodeid]
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        record.update(outcome="skipped", error=_first_line(
            str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr)))
    elif hasattr(report, "wasxfail"):
        record["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed and not _failed(record):  # the first failing phase names it
        record.update(outcome="failed" if call.when == "call" else f"error ({call.when})",
                      error=_error(call.excinfo))
    if call.when == "teardown":
        _write(item.nodeid)
    return report


def _write(nodeid: str) -> None:
    record = _records.pop(nodeid)
    attached = _attach_lines()[_attach_mark.pop(nodeid):]
    record.update(attached=len([a for a in attached if "error" not in a]),
                  attach_errors=[a["error"] for a in attached if "error" in a],
                  gds_persist=sorted({a["from"] for a in attached}))
    with open(os.environ[RECORD_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")


def _attach_lines() -> list[dict[str, Any]]:
    path = Path(os.environ[ATTACH_ENV])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _error(excinfo: Any) -> str:
    if excinfo is None:  # failed without an exception (e.g. a strict xpass)
        return "failed"
    return _first_line(f"{excinfo.typename}: {excinfo.value}") + _worker_frame(excinfo.value)


def _worker_frame(error: BaseException) -> str:
    """Where in the worker it was raised: a ``multiprocessing.Pool`` re-raises the worker's
    exception with its traceback as text in ``__cause__`` (the worker's asserts are not
    rewritten by pytest, so an ``AssertionError`` says nothing else)."""
    cause = error.__cause__
    if type(cause).__name__ != "RemoteTraceback":
        return ""
    lines = str(cause).splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=-1)
    if last < 0:
        return ""
    where = re.match(r'  File "(.*)", line (\d+), in (.*)', lines[last])
    code = lines[last + 1].strip() if last + 1 < len(lines) else ""
    if where is None:
        return ""
    return f" [at {Path(where[1]).name}:{where[2]} {where[3]}: {code}]"


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


# ---------------------------------------------------------------- sources and runs

def extract(git_dir: str, rev: str, dest: Path) -> str:
    """The test sources at ``rev`` into ``dest`` (anew); returns its ``version.txt``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", git_dir, "archive", rev, *EXTRACT], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return subprocess.run(["git", "-C", git_dir, "show", f"{rev}:version.txt"], check=True,
                          capture_output=True, text=True).stdout.strip()


def patch_tests(root: Path) -> list[str]:
    """Apply :data:`TEST_PATCHES` (both runs alike); returns a line for each."""
    lines = []
    for name, text, replacement, why in TEST_PATCHES:
        path = root / name
        source = path.read_text()
        applied = text in source
        path.write_text(source.replace(text, replacement))
        lines.append(f"  {name}: {'removed' if not replacement else 'changed'} "
                     f"{text.strip()!r}: {why}" if applied else f"  {name}: not needed here")
    return lines


def extract_gds_persist(rev: str, work: Path) -> Path:
    """``gds_persist/`` as committed at ``rev``, into ``WORK/gds_persist-REV`` (anew): tested
    in place of the working tree's (first on PYTHONPATH)."""
    dest = work / f"gds_persist-{rev}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "gds_persist"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def suite_env(work: Path, label: str, engine: str, first: Path | None = None
              ) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (
                first, REPO, os.environ.get("PYTHONPATH")) if p),
            "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4",
            "DS_UNITTEST_TIMEOUT": str(TEST_TIMEOUT_S), "OMP_NUM_THREADS": "1",
            ENGINE_ENV: engine, RECORD_ENV: str(work / f"{label}.jsonl"),
            ATTACH_ENV: str(work / f"{label}-attached.jsonl"),
            COLLECTED_ENV: str(work / f"{label}-collected.txt")}


def run_suite(root: Path, label: str, keyword: str | None, first: Path | None) -> tuple[
        dict[str, dict[str, Any]], float]:
    """pytest over SELECTION (``-k keyword``); after a hung test (DeepSpeed's harness ends the
    session) again over the tests not yet run. Returns the records and the wall time."""
    work = root.parent
    env = suite_env(work, label, "gds_persist" if label == "attached" else "stock", first)
    for name in (RECORD_ENV, ATTACH_ENV):
        Path(env[name]).unlink(missing_ok=True)
    start = time.monotonic()
    args: list[str] = [*SELECTION, *(f"--ignore={p}" for p in NOT_RUN),
                       *(["-k", keyword] if keyword else [])]
    for attempt in range(1, 100):
        _pytest(root / "tests", env, args, work / f"{label}-{attempt}.log", label)
        collected = Path(env[COLLECTED_ENV]).read_text().splitlines()
        args = remaining(collected, read_records(Path(env[RECORD_ENV])))
        if not args:
            break
        print(f"{label}: {len(args)} tests left after a hung one; running them", flush=True)
    return read_records(Path(env[RECORD_ENV])), time.monotonic() - start


def _pytest(cwd: Path, env: dict[str, str], args: list[str], log: Path, label: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".",
           "-p", "bench.deepspeed_suite", "-p", "no:cacheprovider", "--color=no", *args]
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
                            ).returncode
    print(f"{label}: pytest exit {rc} in {time.monotonic() - start:.0f} s (log: {log})",
          flush=True)
    if rc not in (0, 1):  # 1: some tests failed (or one hung); else the run itself went wrong
        raise SystemExit(f"{label}: pytest exit {rc}; the end of {log}:\n"
                         + "".join(log.read_text().splitlines(True)[-30:]))


def remaining(collected: Iterable[str], records: dict[str, dict[str, Any]]) -> list[str]:
    """The collected tests without a record, if the run stopped at a hung test (else none:
    a run that ended normally ran everything it collected)."""
    if not any(r["outcome"] == HUNG for r in records.values()):
        return []
    return [nodeid for nodeid in collected if nodeid not in records]


# ---------------------------------------------------------------- the report

def _outcome(record: dict[str, Any] | None) -> str:
    return "not run" if record is None else str(record["outcome"])


def _failed(record: dict[str, Any] | None) -> bool:
    return record is not None and record["outcome"].startswith(("failed", "error", HUNG))


def _passed(record: dict[str, Any] | None) -> bool:
    return record is not None and record["outcome"] == "passed"


def _ran(record: dict[str, Any] | None) -> bool:
    return record is not None and record["outcome"] not in ("skipped", "xfailed")


def differences(stock: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]
                ) -> dict[str, list[str]]:
    """Node ids by kind: ``extra`` (passed stock, failed or hung attached), ``fixed`` (failed
    stock, passed attached), ``other`` (any other change of outcome, e.g. not run),
    ``unattached`` (ran attached, no engine attached)."""
    kinds: dict[str, list[str]] = {"extra": [], "fixed": [], "other": [], "unattached": []}
    for nodeid in sorted(stock.keys() | ours.keys()):
        a, b = stock.get(nodeid), ours.get(nodeid)
        if _passed(a) and _failed(b):
            kinds["extra"].append(nodeid)
        elif _failed(a) and _passed(b):
            kinds["fixed"].append(nodeid)
        elif _outcome(a) != _outcome(b) and not (_failed(a) and _failed(b)):
            kinds["other"].append(nodeid)
        if _ran(b) and b is not None and not b.get("attached"):
            kinds["unattached"].append(nodeid)
    return kinds


def report(stock: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]],
           header: list[str]) -> list[str]:
    kinds = differences(stock, ours)
    lines = [*header, "", f"{'stock':<16} {'attached':<16} {'engines':>7}  test"]
    for nodeid in sorted(stock.keys() | ours.keys()):
        a, b = stock.get(nodeid), ours.get(nodeid)
        engines = "-" if b is None else str(b.get("attached", 0))
        lines.append(f"{_outcome(a):<16} {_outcome(b):<16} {engines:>7}  {nodeid}")
        if nodeid in kinds["extra"]:
            lines.append(f"{'':<43}extra failure: {b['error']}")  # type: ignore[index]
        elif _failed(a) or a is not None and a["outcome"] == "skipped":
            lines.append(f"{'':<43}stock: {a['error']}")  # type: ignore[index]
        for error in [] if b is None else b.get("attach_errors", []):
            lines.append(f"{'':<43}attach raised: {error}")
    return lines + ["", *_totals(stock, ours, kinds)]


def _totals(stock: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]],
            kinds: dict[str, list[str]]) -> list[str]:
    lines = ["totals (tests):"]
    for label, runs in (("stock", stock), ("attached", ours)):
        counts = Counter(r["outcome"] for r in runs.values())
        lines.append(f"  {label:<8} {len(runs)}: " + ", ".join(
            f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    sources = sorted({p for r in ours.values() for p in r.get("gds_persist", [])})
    lines.append(f"attached engines' gds_persist from: {' '.join(sources) or '-'}")
    passed_stock = [n for n, r in stock.items() if _passed(r)]
    lines.append(f"passed stock: {len(passed_stock)}; of these passed attached: "
                 f"{sum(_passed(ours.get(n)) for n in passed_stock)}")
    titles = {"extra": "extra failures (passed stock, failed attached)",
              "fixed": "passed only attached", "other": "other changes of outcome",
              "unattached": "ran attached with no engine attached"}
    for kind, title in titles.items():
        lines.append(f"{title}: {len(kinds[kind])}")
        for nodeid in kinds[kind]:
            record = ours.get(nodeid) or {}
            error = f"  -- {record['error']}" if kind == "extra" else ""
            lines.append(f"  {nodeid}{error}")
    return lines


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    run_or_report(args, ("stock", "attached"), lambda: run_both(args, args.work), report)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-git", help="a git clone of deepspeedai/DeepSpeed (bare "
                                                "is fine); needed unless --report-only")
    parser.add_argument("--rev", default=DEFAULT_REV,
                        help=f"the revision to take the tests from (default {DEFAULT_REV})")
    parser.add_argument("--work", type=Path,
                        default=Path(tempfile.gettempdir()) / "gds_persist-deepspeed-suite",
                        help="scratch directory: the extracted tests, the records, the logs")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--gds-persist-rev", help="test gds_persist as committed at this "
                        "revision of this repository (default: the working tree)")
    parser.add_argument("-k", dest="keyword", help="only the tests pytest -k selects (a trial)")
    parser.add_argument("--runs", choices=("both", "stock", "attached"), default="both",
                        help="run only one of the two (the other's records are those of "
                             "its last run in WORK, if any)")
    parser.add_argument("--report-only", action="store_true",
                        help="report the records of the last runs in WORK again, run nothing")
    args = parser.parse_args(argv)
    if not args.report_only and not args.deepspeed_git:
        parser.error("--deepspeed-git is required (unless --report-only)")
    if REPO in args.work.resolve().parents or args.work.resolve() == REPO:
        parser.error(f"--work must be outside this repository ({REPO})")
    return args


def run_both(args: argparse.Namespace, work: Path) -> tuple[
        list[str], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Extract, run stock then attached; the header says what ran, where, how long."""
    from importlib.metadata import version

    import torch

    git_dir = args.deepspeed_git
    commit = _rev_parse(git_dir, args.rev)
    root = work / f"deepspeed-{commit[:10]}"
    tree_version = extract(git_dir, commit, root)
    patches = patch_tests(root)
    first = None
    if args.gds_persist_rev:
        ours_rev = _rev_parse(str(REPO), args.gds_persist_rev)[:10]
        first = extract_gds_persist(ours_rev, work)
    header = [f"DeepSpeed's checkpoint tests at {commit} (version.txt {tree_version}; "
              f"installed deepspeed {version('deepspeed')}, torch {torch.__version__}), "
              "stock vs gds_persist.integrations.deepspeed.attach(engine) on every engine",
              f"gds_persist {_tested(first)}; load average before: {os.getloadavg()[0]:.2f} "
              f"({os.cpu_count()} cores)",
              "environment: DS_ACCELERATOR=cpu (gloo) LOCAL_SIZE=4 OMP_NUM_THREADS=1 "
              f"DS_UNITTEST_TIMEOUT={TEST_TIMEOUT_S}",
              "selection: " + " ".join(SELECTION)
              + (f" -k {args.keyword!r}" if args.keyword else ""), "not run:",
              *(f"  {path}: {reason}" for path, reason in NOT_RUN.items()),
              "patched in the extracted tests (both runs):", *patches]
    print("\n".join(header), flush=True)
    runs: dict[str, dict[str, dict[str, Any]]] = {"stock": {}, "attached": {}}
    walls = []
    for label in runs:
        if args.runs in ("both", label):
            runs[label], wall = run_suite(root, label, args.keyword, first)
            walls.append(f"{label} {wall:.0f} s")
        else:  # the records of its last run in WORK, if any
            runs[label] = read_records(work / f"{label}.jsonl")
    header.append(f"wall time: {', '.join(walls)}; load average after: "
                  f"{os.getloadavg()[0]:.2f}")
    return header, runs["stock"], runs["attached"]


def _rev_parse(git_dir: str, rev: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                          check=True, capture_output=True, text=True).stdout.strip()


def _tested(first: Path | None) -> str:
    """Which gds_persist the runs import: a committed revision, or the working tree."""
    if first is not None:
        return f"as committed at {first.name.split('-', 1)[1]} (from {first})"
    head = _rev_parse(str(REPO), "HEAD")[:10]
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "gds_persist"],
                           capture_output=True, text=True).stdout.split()[1::2]
    return f"working tree at {head}" + (f", modified: {' '.join(dirty)}" if dirty else "")


if __name__ == "__main__":
    main()
