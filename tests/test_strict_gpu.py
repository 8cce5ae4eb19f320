"""tests/strict_gpu.py: on a GPU machine a skipped ``gpu`` test fails; on a CPU machine it skips.

Real pytest runs in a subprocess over a small test file, with ``--strict-gpu=on`` standing for a
machine with a CUDA device (where ``auto``, the default, turns it on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CASES = '''
import pytest

@pytest.fixture
def needs_kvikio():
    pytest.skip("kvikio not importable (no module named kvikio)")

@pytest.mark.gpu
def test_kernel():
    pytest.skip("device CRC32C kernel unusable (DeprecationWarning: ExternalStream is deprecated)")

@pytest.mark.gpu
def test_fixture(needs_kvikio):
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="cupy not importable")
def test_skipif_mark():
    pass

@pytest.mark.gpu
def test_ok():
    pass

def test_cpu_skip():
    pytest.skip("not a GPU test: may skip anywhere")

@pytest.mark.gpu
@pytest.mark.xfail(reason="expected", strict=True)
def test_xfail():
    raise RuntimeError("known")
'''


def _pytest(tmp_path: Path, *args: str) -> tuple[int, str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"}  # untruncated summary
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.strict_gpu", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull, "-rA", "-W", "error",
         str(tmp_path / "test_cases.py"), *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_on_a_gpu_machine_gpu_skips_fail(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, "--strict-gpu=on")
    assert rc == 1, out
    assert "FAILED test_cases.py::test_kernel - GPU test skipped on a machine with a CUDA " \
           "device: device CRC32C kernel unusable" in out
    assert "ERROR test_cases.py::test_fixture - GPU test skipped" in out  # in setup: an error
    assert "kvikio not importable" in out
    assert "ERROR test_cases.py::test_skipif_mark - GPU test skipped" in out
    assert "cupy not importable" in out
    assert "PASSED test_cases.py::test_ok" in out
    assert "SKIPPED [1] test_cases.py" in out and "not a GPU test" in out  # unmarked: a skip
    assert "XFAIL test_cases.py::test_xfail" in out  # an expected failure is not a skip
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out


def test_off_keeps_the_skips(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, "--strict-gpu=off")
    assert rc == 0, out
    assert "1 passed, 4 skipped, 1 xfailed" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default; this has CUDA")
def test_auto_on_a_cpu_machine_skips_with_the_reason(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path)
    assert rc == 0, out
    assert "device CRC32C kernel unusable" in out and "1 passed, 4 skipped" in out


def test_bad_value_is_refused(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, "--strict-gpu=maybe")
    assert rc == 4 and "invalid choice: 'maybe'" in out
