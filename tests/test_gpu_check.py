"""bench/gpu_check.sh (the one-shot GPU verification) and bench/gpu_facts.py, checked on CPU:
syntax, arguments, a clear "NOT RUN: no CUDA device" without a GPU, and a dry run of the whole
script (tests, comparison, budget logic, summary) with ``--device cpu`` at a tiny size."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@needs_bash
@pytest.mark.parametrize("script", ["gpu_check.sh", "fetch_gpu_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "bench" / script)], check=True)


@needs_bash
def test_help_and_bad_arguments():
    results = set(os.listdir(REPO / "bench" / "results"))
    out = _run("--help")
    assert out.returncode == 0 and "--wheels DIR" in out.stdout
    assert out.stdout.rstrip().endswith("device (nothing verified, the reason is in summary.md); "
                                        "2 bad arguments.")  # the whole header, no more
    bad = _run("--frobnicate")
    assert bad.returncode == 2 and "unknown argument --frobnicate" in bad.stderr
    mismatch = _run("--sizes", "1GiB 2GiB", "--runs", "1")
    assert mismatch.returncode == 2 and "same number" in mismatch.stderr
    assert set(os.listdir(REPO / "bench" / "results")) == results  # bad arguments create nothing


def test_gpu_facts_never_raises(tmp_path):
    out = tmp_path / "facts.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "gpu_facts.py"), "--json", str(out)],
                   check=True, cwd=tmp_path, capture_output=True, timeout=120)
    facts = json.loads(out.read_text())
    assert facts["cuda"] == torch.cuda.is_available()
    if not facts["cuda"]:
        assert facts["why_no_cuda"] and facts["gpu_summary"].startswith("no GPU")
        assert facts["gds"] is False
    assert not (tmp_path / "cufile.log").exists()


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the no-GPU exit; this machine has CUDA")
def test_without_a_gpu_it_says_not_run(tmp_path):
    out = _run("--out", str(tmp_path / "o"))
    assert out.returncode == 3, out.stderr
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "NOT RUN: no CUDA device" in summary
    assert "torch.cuda.is_available() is False" in summary
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["gpu_check.tar.gz", "summary.md"]
    assert (_unpack(tmp_path / "o", tmp_path / "u") / "facts.json").is_file()  # packed on exit 3


def _unpack(out_dir: Path, into: Path) -> Path:
    with tarfile.open(out_dir / "gpu_check.tar.gz") as tar:
        tar.extractall(into, filter="data")
    return into / "gpu_check"


@needs_bash
@pytest.mark.slow
def test_dry_run_on_cpu(tmp_path):
    """The whole flow with --device cpu: GPU tests (all skip here), the drive comparison at a tiny
    size, the warm-up, training and tmpfs benchmarks, the DCP thread count carried from the first
    size, the summary, and everything packed into one tarball beside summary.md."""
    o = tmp_path / "o"
    shm = Path("/dev/shm")
    tmpfs = (shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) / f"gc-{os.getpid()}"
    out = _run("--out", str(o), "--device", "cpu", "--sizes", "8MiB 16MiB", "--runs", "1 1",
               "--dir", str(tmp_path / "bench"), "--budget-s", "400", "--warmup-size", "4MiB",
               "--tmpfs-size", "8MiB", "--tmpfs-dir", str(tmpfs),
               "--train-args", "--tiny --modes gds_auto",  # the steps' flow, not every method
               "--tests", "tests/test_gpu_path.py tests/test_kernels.py", timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in o.iterdir()) == ["gpu_check.tar.gz", "summary.md"]  # <= 8 files
    summary = (o / "summary.md").read_text()
    assert "DRY RUN on the CPU" in summary
    assert "## pytest -m gpu --strict-gpu=off (exit 0)" in summary
    assert "GPU test(s) skipped: expected in a dry run without a GPU" in summary
    skipped = re.search(r"\n(\d+) GPU test\(s\) skipped", summary)
    assert skipped and int(skipped.group(1)) > 0  # the narrowed paths hold GPU tests
    assert "## bench-8MiB: 1 run(s) in " in summary and "gds_persist direct" in summary
    assert "torch.save" in summary
    assert "not run: gds_persist kvikio" in summary or "gds_persist kvikio" in summary
    assert "## warmup (exit 0)" in summary and "first/next" in summary
    assert "## train (exit 0)" in summary and "gds_auto" in summary
    assert "## tmpfs-8MiB: 1 run(s) in " in summary and "gds_persist buffered" in summary
    files = _unpack(o, tmp_path / "unpacked")
    assert (files / "summary.md").read_text() == summary
    for name in ("facts.json", "facts.txt", "pytest-gpu.xml", "pytest-gpu.txt", "gpu_check.log",
                 "bench-8MiB.json", "warmup.json", "train.json", "tmpfs-8MiB.json"):
        assert (files / name).is_file(), name
    record = json.loads((files / "bench-8MiB.json").read_text())
    assert record["config"]["device"] == "cpu"
    assert json.loads((files / "warmup.json").read_text())["device"] == "cpu"
    assert not (files / "bench-16.0GiB.json").exists()  # below 2 GiB: run or skipped, not shrunk
    if (files / "bench-16MiB.json").exists():
        dcp = json.loads((files / "bench-16MiB.json").read_text())["config"]["dcp_threads"]
        assert len(dcp) == 1  # the first size's best DCP thread count, not a new calibration
    else:
        assert "bench-16MiB: skipped" in summary
    assert not list((tmp_path / "bench").iterdir())  # the benchmarks cleaned up
    assert not tmpfs.exists()
    assert not (REPO / "cufile.log").exists()


@needs_bash
def test_no_pack_leaves_the_files(tmp_path):
    o = tmp_path / "o"
    out = _run("--out", str(o), "--device", "cpu", "--no-tests", "--no-bench", "--no-pack")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in o.iterdir()) == ["gpu_check", "summary.md"]
    assert (o / "gpu_check" / "facts.json").is_file()
    assert (o / "gpu_check" / "summary.md").read_text() == (o / "summary.md").read_text()


# what a CUDA torch image brings of gds_persist's dependencies (the H200 image has all three)
IMAGE_HAS = {"torch", "numpy", "nvidia-ml-py"}


def test_every_other_dependency_travels_as_a_wheel():
    """A dependency added to pyproject.toml but not to gpu_check.sh's CORE_DEPS and
    fetch_gpu_wheels.sh is missing on a GPU machine without network: every test that needs it
    fails there (blake3 and blosc2 did on the H200)."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps} - IMAGE_HAS
    check = SCRIPT.read_text()
    core = re.search(r"^CORE_DEPS=\((.*)\)$", check, re.M)
    assert core, "gpu_check.sh has no CORE_DEPS=(...) line"
    wheels = {w for entry in re.findall(r'"([^"]*)"', core.group(1)) for w in entry.split()[1:]}
    assert needed <= wheels, f"gpu_check.sh does not install {sorted(needed - wheels)}"
    fetch = (REPO / "bench" / "fetch_gpu_wheels.sh").read_text()
    gets = set(" ".join(re.findall(r"^\s*get .*$", fetch, re.M)).split())
    assert wheels <= gets, f"fetch_gpu_wheels.sh does not download {sorted(wheels - gets)}"
