"""bench/gpu_check.sh (the one-shot GPU verification) and bench/gpu_facts.py, checked on CPU:
syntax, arguments, a clear "NOT RUN: no CUDA device" without a GPU, and a dry run of the whole
script (tests, comparison, budget logic, summary) with ``--device cpu`` at a tiny size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
    out = _run("--help")
    assert out.returncode == 0 and "--wheels DIR" in out.stdout
    bad = _run("--frobnicate")
    assert bad.returncode == 2 and "unknown argument --frobnicate" in bad.stderr
    mismatch = _run("--sizes", "1GiB 2GiB", "--runs", "1")
    assert mismatch.returncode == 2 and "same number" in mismatch.stderr


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


@needs_bash
@pytest.mark.slow
def test_dry_run_on_cpu(tmp_path):
    """The whole flow with --device cpu: GPU tests (all skip here), the comparison at a tiny
    size, the DCP thread count carried from the first size, the summary."""
    o = tmp_path / "o"
    out = _run("--out", str(o), "--device", "cpu", "--sizes", "8MiB 16MiB", "--runs", "1 1",
               "--dir", str(tmp_path / "bench"), "--budget-s", "400", timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = (o / "summary.md").read_text()
    assert "DRY RUN on the CPU" in summary
    assert "## pytest -m gpu (exit 0)" in summary
    assert "### 8MiB, 1 run(s) (exit 0)" in summary
    assert "gds_persist direct" in summary and "torch.save" in summary
    assert "not run: gds_persist kvikio" in summary or "gds_persist kvikio" in summary
    record = json.loads((o / "bench-8MiB.json").read_text())
    assert record["config"]["device"] == "cpu"
    second = o / "bench-16.0GiB.json"
    assert not second.exists()  # sizes below 2 GiB are never shrunk, only run or skipped
    if (o / "bench-16MiB.json").exists():
        dcp = json.loads((o / "bench-16MiB.json").read_text())["config"]["dcp_threads"]
        assert len(dcp) == 1  # the first size's best DCP thread count, not a new calibration
    else:
        assert "16MiB: skipped" in summary
    assert not list((tmp_path / "bench").glob("bench-*"))  # the benchmark cleaned up
    assert not (REPO / "cufile.log").exists()
