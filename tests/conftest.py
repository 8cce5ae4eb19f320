"""Shared fixtures.

* ``backend``: every I/O backend, parametrised, so one conformance suite runs against each.
  ``direct`` and ``buffered`` always run (``direct`` needs a filesystem with O_DIRECT under
  pytest's tmp dir, e.g. ext4 /tmp); ``kvikio`` carries the ``gpu`` mark and is skipped with the
  reason (no CUDA device, kvikio not importable) on CPU machines. With ``kvikio`` the tensors
  under test live on the GPU.
* ``small_tmpfs``: a freshly mounted 8 MiB tmpfs (root only), for disk-full and no-O_DIRECT cases.
* every test starts with no ``GDS_PERSIST_*`` environment variables and no ``settings.set``
  overrides, and no cached staging ring survives it; its read-mode history, in memory and on
  disk (``GDS_PERSIST_CACHE_DIR``), is its own, empty at the start.
* on a machine with a CUDA device a ``gpu``-marked test that skips fails instead
  (``tests/strict_gpu.py``, ``--strict-gpu``).
* every test's randomness (``random``, NumPy, torch, Hypothesis, the ``test_seed`` fixture)
  comes from one seed the header prints; ``GDS_PERSIST_TEST_SEED=N`` replays it
  (``tests/seeds.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gds_persist import settings
from gds_persist.backends import read_history, read_mode, supports_o_direct
from gds_persist.backends.posix import filesystem_type, o_direct_host_alignment
from gds_persist.transfer.staging import release_cached
from tests import seeds, strict_gpu
from tests.helpers import BackendCase, kvikio_missing, prefer_installed_kernels
from tests.strict_gpu import (  # noqa: F401 - pytest hooks, registered by being here
    pytest_addoption,
    pytest_runtest_makereport,
)

prefer_installed_kernels()  # before anything imports transformers


def pytest_configure(config: pytest.Config) -> None:
    strict_gpu.pytest_configure(config)
    config.pluginmanager.register(seeds, "gds_persist_seeds")  # its own makereport hook

TMPFS_BYTES = 8 << 20


@pytest.fixture(
    params=["direct", "buffered", pytest.param("kvikio", marks=pytest.mark.gpu)],
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> BackendCase:
    name = request.param
    if name == "kvikio":
        missing = kvikio_missing()
        if missing:
            pytest.skip(f"kvikio backend: {missing}")
        return BackendCase(name, "cuda")
    if name == "direct":
        ok, why = supports_o_direct(str(tmp_path))
        if not ok:
            pytest.skip(f"direct backend: the test tmp dir refuses O_DIRECT ({why})")
    return BackendCase(name, "cpu")


@pytest.fixture(autouse=True)
def _pristine_settings(monkeypatch: pytest.MonkeyPatch,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    for env in settings.ENV_VARS.values():
        monkeypatch.delenv(env, raising=False)
    # no test reads or writes the user's read-mode history, nor another test's
    monkeypatch.setenv(read_history.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
    read_mode.forget()
    with settings._lock:  # run with no programmatic overrides, restored afterwards
        saved = dict(settings._overrides)
        settings._overrides.clear()
    try:
        yield
    finally:
        with settings._lock:
            settings._overrides.clear()
            settings._overrides.update(saved)
    release_cached()
    read_mode.forget()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (root only; skipped with the reason otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm (tmpfs, which takes O_DIRECT from any address on these kernels)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = Path("/dev/shm") / f"gdsp-test-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if filesystem_type(fd) != "tmpfs":
                pytest.skip(f"/dev/shm is {filesystem_type(fd)!r}, not tmpfs")
        finally:
            os.close(fd)
        if o_direct_host_alignment(str(path)) > 64:
            pytest.skip("O_DIRECT on /dev/shm needs aligned memory on this kernel")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
