"""Lightning's own checkpoint tests, run twice: stock, and with ``GdsPersistCheckpointIO`` as
the default CheckpointIO (docs/INTEGRATIONS.md, "Lightning's own tests against the plugin").

    python bench/lightning_suite.py --lightning-git DIR [--tag 2.6.5] [--work DIR] [--out FILE]

1. Lightning's test sources are not in its wheel: they come from a git clone of
   Lightning-AI/pytorch-lightning (a bare one is fine), at the tag of the installed lightning,
   else the newest release tag below it (printed). ``tests/tests_pytorch``, ``tests/legacy`` and
   ``pyproject.toml`` (Lightning's pytest settings: addopts, filterwarnings) are extracted into
   ``WORK/lightning-TAG`` anew each run, never into this repository.
2. What those tests import beyond lightning (:data:`TEST_EXTRAS`, pinned as in Lightning's
   ``requirements/pytorch/{test,extra}.txt``) is installed with pip into a venv of its own,
   ``WORK/venv``: it sees this interpreter's site-packages through a ``.pth`` file and installs
   under a constraints file of their ``pip freeze``, so torch, lightning and the rest stay the
   ones installed here and this interpreter's environment is never changed.
3. pytest runs :data:`SELECTION` in that venv twice, with this module as a plugin
   (``-p bench.lightning_suite``) that records each test's outcome and error. In the second run
   (``GDS_PERSIST_SUITE_IO=gds_persist``) the plugin replaces the one name Lightning's
   ``Strategy.checkpoint_io`` builds its default from,
   ``lightning.pytorch.strategies.strategy.TorchCheckpointIO``, by ``GdsPersistCheckpointIO``:
   every Trainer given no CheckpointIO plugin writes through ours (also inside
   ``AsyncCheckpointIO``, which takes the strategy's default), while a test that builds, checks
   or mocks ``TorchCheckpointIO`` by its own name still gets Lightning's.
4. It prints every test's two outcomes, and for each extra failure (passed stock, failed with
   ours) a class (:data:`CLASSES`) and the first line of the error; counts at the end.

Not run: ``checkpointing/test_legacy_checkpoints.py`` (it loads checkpoints of 114 earlier
releases that Lightning's CI downloads first; without them every case fails either way). On the
2-core VM: about 70 s stock, 90-130 s ours, and a minute for the venv the first time.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.suites import read_records, run_or_report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TESTS = "tests/tests_pytorch"
# trainer/test_trainer.py is large: only its checkpoint and ckpt_path tests
TRAINER_CKPT_TESTS = (
    "test_model_checkpoint_options", "test_model_checkpoint_only_weights",
    "test_fit_ckpt_path_epoch_restored", "test_checkpoint_path_input_last_fault_tolerant",
    "test_checkpoint_path_input_last", "test_checkpoint_find_last", "test_checkpoint_path_input",
    "test_tested_checkpoint_path_best", "test_best_ckpt_evaluate_raises_warning_with_multiple_"
    "ckpt_callbacks", "test_on_load_checkpoint_missing_callbacks",
    "test_trainer_save_checkpoint_no_model_attached")
SELECTION = (
    f"{TESTS}/checkpointing", f"{TESTS}/plugins/test_checkpoint_io_plugin.py",
    f"{TESTS}/plugins/test_async_checkpoint.py", f"{TESTS}/models/test_restore.py",
    f"{TESTS}/trainer/connectors/test_checkpoint_connector.py",
    *(f"{TESTS}/trainer/test_trainer.py::{name}" for name in TRAINER_CKPT_TESTS))
NOT_RUN = (f"{TESTS}/checkpointing/test_legacy_checkpoints.py",)
TEST_EXTRAS = (
    "cloudpickle>=1.3,<3.2.0", "scikit-learn>0.22.1,<1.9.0", "tensorboard>=2.11,<2.21.0",
    "jsonargparse[signatures]>=4.39.0,<4.46.0", "omegaconf>=2.2.3,<2.4.0",
    "pytest-rerunfailures==16.1", "pytest-timeout==2.4.0")
IO_ENV = "GDS_PERSIST_SUITE_IO"        # "gds_persist": our plugin is the default CheckpointIO
RECORD_ENV = "GDS_PERSIST_SUITE_RECORD"  # the JSON-lines file the plugin appends a test to
TEST_TIMEOUT_S = 300  # pytest-timeout, per test: a hang fails that test, not the run


# ---------------------------------------------------------------- the pytest plugin (in the venv)

def pytest_configure(config: Any) -> None:
    if os.environ.get(IO_ENV) == "gds_persist":
        swap_default_checkpoint_io()


def swap_default_checkpoint_io() -> None:
    """Lightning's Strategy builds its default CheckpointIO (and an AsyncCheckpointIO's inner
    one) from this module-level name; nothing else is changed."""
    import lightning.pytorch.strategies.strategy as strategy

    from gds_persist.integrations.lightning import GdsPersistCheckpointIO

    strategy.TorchCheckpointIO = GdsPersistCheckpointIO  # type: ignore[assignment,misc]


_records: dict[str, dict[str, Any]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Generator[None, Any, Any]:
    report = yield
    if call.when == "setup":  # a rerun (pytest-rerunfailures) starts afresh
        _records[item.nodeid] = {"nodeid": item.nodeid, "outcome": "passed"}
    record = _records[item.nodeid]
    if report.skipped and not hasattr(report, "wasxfail"):
        record.update(outcome="skipped", error=_first_line(str(report.longrepr[-1])
                                                           if isinstance(report.longrepr, tuple)
                                                           else str(report.longrepr)))
    elif hasattr(report, "wasxfail"):
        record["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed and not _failed(record):  # the first failing phase names it
        record.update(outcome="failed" if call.when == "call" else f"error ({call.when})",
                      **_describe(item, call.excinfo))
    if call.when == "teardown":
        with open(os.environ[RECORD_ENV], "a") as f:
            f.write(json.dumps(record) + "\n")
    return report


def _describe(item: Any, excinfo: Any) -> dict[str, Any]:
    if excinfo is None:  # failed without an exception (e.g. a strict xpass)
        return {"error": "failed", "frames": [], "source": ""}
    stack = traceback.extract_tb(excinfo.tb)
    first = next((i for i, f in enumerate(stack) if _in_tests_dir(f.filename)), 0)
    frames = stack[first:]  # from the test's own frame down, not pytest's
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        source = ""
    return {"error": _first_line(f"{excinfo.typename}: {excinfo.value}"),
            "frames": [[f.filename, f.name, f.line or ""] for f in frames], "source": source}


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 200 else line[:197] + "..."


# ---------------------------------------------------------------- classifying an extra failure

def _in_tests_dir(filename: str) -> bool:
    return f"{os.sep}tests_pytorch{os.sep}" in filename


def _in_tests(frames: list[list[str]]) -> list[list[str]]:
    return [f for f in frames if _in_tests_dir(f[0])]


def _mocks_torch_io(r: dict[str, Any]) -> bool:
    return bool(re.search(r"""mock\.patch\(\s*["']torch\.save["']|Mock\(wraps=torch\.save\)"""
                          r"|TorchCheckpointIO", r["source"] + " ".join(
                              line for _, _, line in _in_tests(r["frames"]))))


def _mocks_os_rename(r: dict[str, Any]) -> bool:
    """The test makes every ``os.rename`` fail (a cross-device write simulated for fsspec):
    the plugin's atomic commit renames within the checkpoint's own directory."""
    return bool(re.search(r"""mock\.patch\(\s*["']os\.rename["']""", r["source"]))


def _http_url(r: dict[str, Any]) -> bool:
    return any(name == "load_state_dict_from_url" for _, name, _ in r["frames"])


def _fsspec_url(r: dict[str, Any]) -> bool:
    return "not at a URL" in r["error"]


def _not_copyable(r: dict[str, Any]) -> bool:
    return bool(re.search(r"[Cc]an(not|'t) pickle", r["error"]))


def _refused_leaf(r: dict[str, Any]) -> bool:
    return "cannot checkpoint an object of type" in r["error"]


def _load_from_checkpoint(r: dict[str, Any]) -> bool:
    return r["error"].startswith("IsADirectoryError") and any(
        name in ("load_from_checkpoint", "_load_from_checkpoint") for _, name, _ in r["frames"])


def _torch_load(r: dict[str, Any]) -> bool:
    tests = _in_tests(r["frames"])
    return bool(tests) and bool(re.search(r"torch\.load\(|pl_load\(|\b_load\(", tests[-1][2]))


def _asserts_file(r: dict[str, Any]) -> bool:
    tests = _in_tests(r["frames"])
    return bool(tests) and bool(re.search(r"isfile|is_file\(|getsize", tests[-1][2]))


# in order: the first that holds names the failure
CLASSES: tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...] = (
    ("mocks torch.save or TorchCheckpointIO", _mocks_torch_io),
    ("mocks os.rename (the atomic commit renames)", _mocks_os_rename),
    ("URL checkpoint over HTTP (must be a file)", _http_url),
    ("fsspec URL (the plugin writes local paths)", _fsspec_url),
    ("the plugin is not deep-copyable/picklable", _not_copyable),
    ("a hyper-parameter the directory format refuses", _refused_leaf),
    ("load_from_checkpoint of a directory", _load_from_checkpoint),
    ("torch.load of the path", _torch_load),
    ("asserts the checkpoint is a file", _asserts_file),
)


def classify(record: dict[str, Any]) -> str:
    return next((name for name, holds in CLASSES if holds(record)), "other")


# ---------------------------------------------------------------- sources, venv, runs

def installed_lightning() -> str:
    from importlib.metadata import version

    return version("lightning")


def pick_tag(git_dir: str, installed: str) -> str:
    """The tag of ``installed``, else the newest release tag (X.Y.Z) below it."""
    def key(tag: str) -> tuple[int, ...]:
        return tuple(int(x) for x in tag.split("."))

    tags = subprocess.run(["git", "-C", git_dir, "tag", "--list"], check=True,
                          capture_output=True, text=True).stdout.split()
    releases = [t for t in tags if re.fullmatch(r"\d+\.\d+\.\d+", t)]
    want = key(re.match(r"\d+\.\d+\.\d+", installed).group(0))  # type: ignore[union-attr]
    below = [t for t in releases if key(t) <= want]
    if not below:
        raise SystemExit(f"{git_dir}: no release tag at or below lightning {installed}")
    return max(below, key=key)


def extract(git_dir: str, tag: str, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for path in ("tests/tests_pytorch", "tests/legacy"):
        archive = subprocess.run(["git", "-C", git_dir, "archive", tag, path], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
    (dest / "pyproject.toml").write_bytes(subprocess.run(
        ["git", "-C", git_dir, "show", f"{tag}:pyproject.toml"], check=True,
        capture_output=True).stdout)


def ensure_venv(work: Path) -> Path:
    """WORK/venv: this interpreter's packages through a .pth, the test extras pip-installed
    beside them under a constraints file of this interpreter's ``pip freeze``."""
    venv = work / "venv"
    python = venv / "bin" / "python"
    stamp = venv / "gds_persist-extras.txt"
    wanted = "\n".join(TEST_EXTRAS) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                               "get_paths()['purelib'])"], check=True, capture_output=True,
                              text=True).stdout.strip()
        Path(site, "_harness_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout
    constraints = work / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in frozen.splitlines()
                                   if line and " @ " not in line and not line.startswith("-")))
    print(f"installing into {venv}: {' '.join(TEST_EXTRAS)}", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(constraints),
                    *TEST_EXTRAS], check=True)
    stamp.write_text(wanted)
    return python


def run_suite(python: Path, root: Path, label: str, env_io: str) -> dict[str, dict[str, Any]]:
    record = root.parent / f"{label}.jsonl"
    log = root.parent / f"{label}.log"
    record.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), RECORD_ENV: str(record), IO_ENV: env_io}
    cmd = [str(python), "-m", "pytest", "-p", "bench.lightning_suite", "-p", "no:cacheprovider",
           "-q", "--color=no", f"--timeout={TEST_TIMEOUT_S}",
           *(f"--ignore={p}" for p in NOT_RUN), *SELECTION]
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    print(f"{label}: pytest exit {rc} in {time.monotonic() - start:.0f} s (log: {log})",
          flush=True)
    if rc not in (0, 1):  # 1: some tests failed; anything else: the run itself went wrong
        raise SystemExit(f"{label}: pytest exit {rc}; the end of {log}:\n"
                         + "".join(log.read_text().splitlines(True)[-30:]))
    return read_records(record)


# ---------------------------------------------------------------- the report

def _outcome(record: dict[str, Any] | None) -> str:
    return "not run" if record is None else str(record["outcome"])


def _failed(record: dict[str, Any] | None) -> bool:
    return record is not None and record["outcome"].startswith(("failed", "error"))


def report(stock: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]],
           header: list[str]) -> list[str]:
    lines = [*header, "", f"{'stock':<16} {'ours':<16} test"]
    extra: dict[str, list[str]] = {name: [] for name, _ in (*CLASSES, ("other", None))}
    fixed = []
    for nodeid in sorted(stock.keys() | ours.keys()):
        a, b = stock.get(nodeid), ours.get(nodeid)
        lines.append(f"{_outcome(a):<16} {_outcome(b):<16} {nodeid}")
        if a is not None and a["outcome"] == "passed" and _failed(b):
            assert b is not None
            kind = classify(b)
            extra[kind].append(nodeid)
            lines.append(f"{'':<33}extra failure [{kind}]: {b['error']}")
        elif _failed(a) and b is not None and b["outcome"] == "passed":
            fixed.append(nodeid)
    lines += ["", "totals (tests):"]
    for label, runs in (("stock", stock), ("ours", ours)):
        counts = Counter(r["outcome"] for r in runs.values())
        lines.append(f"  {label:<6} {len(runs)}: " + ", ".join(
            f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    lines.append("extra failures with GdsPersistCheckpointIO (passed stock): "
                 f"{sum(map(len, extra.values()))} tests of "
                 f"{len({n.split('[')[0] for ids in extra.values() for n in ids})} functions")
    for kind, ids in extra.items():
        functions = len({n.split("[")[0] for n in ids})
        lines.append(f"  {len(ids):>3} ({functions:>2} functions)  {kind}")
    lines.append(f"passed only with ours: {len(fixed)}" + "".join(f"\n  {n}" for n in fixed))
    return lines


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    run_or_report(args, ("stock", "ours"),
                  lambda: run_both(args.lightning_git, args.tag, args.work), report)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning-git", required=True,
                        help="a git clone of Lightning-AI/pytorch-lightning (bare is fine)")
    parser.add_argument("--tag", help="the tag to test (default: the installed version's, or "
                                      "the newest release below it)")
    parser.add_argument("--work", type=Path,
                        default=Path(tempfile.gettempdir()) / "gds_persist-lightning-suite",
                        help="scratch directory: the extracted tests, the venv, the logs")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--report-only", action="store_true",
                        help="report the records of the last runs in WORK again, run nothing")
    return parser.parse_args(argv)


def run_both(git_dir: str, tag: str | None, work: Path) -> tuple[
        list[str], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Extract, make the venv, run stock then ours; the header says what ran, where, at what
    load."""
    import torch

    installed = installed_lightning()
    tag = tag or pick_tag(git_dir, installed)
    root = work / f"lightning-{tag}"
    extract(git_dir, tag, root)
    python = ensure_venv(work)
    header = [f"Lightning's checkpoint tests at tag {tag} (installed lightning {installed}, "
              f"torch {torch.__version__}), stock vs GdsPersistCheckpointIO as the default "
              "CheckpointIO",
              f"gds_persist at {_commit()}; load average before: {os.getloadavg()[0]:.2f} "
              f"({os.cpu_count()} cores)", "selection: " + " ".join(SELECTION),
              "not run: " + " ".join(NOT_RUN)]
    print("\n".join(header), flush=True)
    stock = run_suite(python, root, "stock", "stock")
    ours = run_suite(python, root, "ours", "gds_persist")
    header.append(f"load average after: {os.getloadavg()[0]:.2f}")
    return header, stock, ours


def _commit() -> str:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "gds_persist"],
                           capture_output=True, text=True).stdout.strip()
    return head + (" (gds_persist/ modified)" if dirty else "")


if __name__ == "__main__":
    main()
