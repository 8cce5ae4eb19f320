"""Helpers shared by the test files: exact comparison of state dicts, raw access to checkpoints."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import math
import os
import shlex
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gds_persist import Checkpointer
from gds_persist.backends import supports_o_direct
from gds_persist.format import MANIFEST_NAME, canonical, crc32c

_REPO = Path(__file__).resolve().parent.parent


class HookedCheckpointer(Checkpointer):
    """A Checkpointer whose writer thread calls ``before_write(step)`` before each write: a
    gate, a drive slower than training, a crash of the writer thread."""

    before_write: Callable[[int], Any] | None = None

    def _write(self, job: Any) -> None:
        if self.before_write is not None:
            self.before_write(job.handle.step)
        super()._write(job)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in logical order, for any dtype (== is not defined on all)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_tensor_equal(got: torch.Tensor, want: torch.Tensor, where: str = "") -> None:
    assert type(got) is type(want), f"{where}: type {type(got)} != {type(want)}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert got.stride() == want.stride(), f"{where}: stride {got.stride()} != {want.stride()}"
    assert got.storage_offset() == want.storage_offset(), f"{where}: storage offset"
    assert got.requires_grad == want.requires_grad, f"{where}: requires_grad"
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes(), f"{where}: storage"
    assert raw_bytes(got) == raw_bytes(want), f"{where}: bytes differ"


def assert_tree_equal(got: Any, want: Any, where: str = "<root>",
                      device: str | None = None) -> None:
    """Exact structural equality: container types, key order, float bits (nan == nan), tensors.

    ``device``: the device every loaded tensor must be on (default: the original's device).
    """
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.device == torch.device(device or want.device), f"{where}: device {got.device}"
        assert_tensor_equal(got, want, where)
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{where}: keys differ"
        assert [type(k) for k in got] == [type(k) for k in want], f"{where}: key types differ"
        for k in want:
            assert_tree_equal(got[k], want[k], f"{where}[{k!r}]", device)
        if isinstance(want, OrderedDict) or hasattr(want, "_metadata"):
            assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), where
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_tree_equal(g, w, f"{where}[{i}]", device)
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)
        ), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def random_tensor(dtype: torch.dtype, numel: int, seed: int = 0,
                  device: str = "cpu") -> torch.Tensor:
    """``numel`` elements of ``dtype`` with random bits (random NaN payloads for floats)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).to(device).bool()
    nbytes = numel * dtype.itemsize
    # move the bytes, then reinterpret: sub-byte dtypes (uint1..int7) have no copy kernel
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device).view(dtype)


def data_files(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every data file of a checkpoint, name -> content."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.name != MANIFEST_NAME}


def manifest_doc(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST_NAME).read_bytes())


def rewrite_manifest(path: str | os.PathLike[str], edit: Callable[[dict[str, Any]], Any],
                     reseal: bool = True, whole: bool = False) -> None:
    """Apply ``edit`` to the manifest body (``whole``: to the whole document); with ``reseal``
    recompute ``body_crc32c`` as the writer does, so only the validator (not the body checksum)
    can catch the edit."""
    doc = manifest_doc(path)
    edit(doc if whole else doc["body"])
    if reseal:
        doc["body_crc32c"] = crc32c(canonical(doc["body"]))
    (Path(path) / MANIFEST_NAME).write_text(json.dumps(doc, indent=1))


def flip_byte(file: str | os.PathLike[str], offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@contextlib.contextmanager
def s3_server(bucket: str, gate: bool = False) -> Iterator[Any]:
    """bench/s3_server.py's server (with its relay: ``gate``), a bucket made, and this
    process's AWS variables pointing at it alone until the ``with`` ends."""
    import pytest

    from bench.s3_server import S3Server

    with S3Server(bucket, gate=gate) as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env.items():
            mp.setenv(k, v)
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        yield server


def open_fds() -> set[str]:
    """This process's open descriptors, as ``fd -> target`` strings."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return out


def kvikio_missing() -> str | None:
    """Why the kvikio backend cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio not importable ({e}); install the gpu extra"
    return None


def cuda_missing() -> str | None:
    if torch.cuda.is_available():
        return None
    return "no CUDA device (torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class BackendCase:
    """A backend under test and the device its tensors live on."""

    name: str
    device: str

    def __str__(self) -> str:
        return self.name


def available_backends(directory: str) -> list[BackendCase]:
    """Every backend that can run here (for tests comparing backends with each other)."""
    out = [BackendCase("buffered", "cpu")]
    if supports_o_direct(directory)[0]:
        out.insert(0, BackendCase("direct", "cpu"))
    if kvikio_missing() is None:
        out.append(BackendCase("kvikio", "cuda"))
    return out


def device_kernel_or_skip(status: Callable[[], tuple[bool, str]]) -> Any:
    """torch, or a skip (saying why) unless CUDA, cupy and the device kernel that ``status``
    reports on (``device_crc_status``, ``device_hash_status``) are usable."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cupy not importable ({e})")
    ok, why = status()
    if not ok:
        pytest.skip(why)
    return torch


def random_device_pieces(total: int, lengths: list[int], more: int,
                         seed: int) -> list[tuple[Any, Any]]:
    """(CUDA slice, its host bytes) of one random uint8 CUDA tensor of ``total`` bytes: one
    piece of each of ``lengths``, then ``more`` of random lengths, each at a random start."""
    import random

    rng = random.Random(seed)
    big = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    host = big.cpu().numpy()
    lengths = lengths + [rng.randrange(1, total) for _ in range(more)]
    starts = [rng.randrange(0, total - n + 1) if n < total else 0 for n in lengths]
    return [(big[s : s + n], host[s : s + n]) for s, n in zip(starts, lengths, strict=True)]


# --- the CUDA kernels without a GPU: compilers only ----------------------------------------------

NVCC_FLAGS = ["-arch=sm_90", "-Werror", "all-warnings"]


def nvcc_or_skip() -> str:
    import shutil

    import pytest

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc (CUDA toolkit) not on PATH")
    return nvcc


def nvcc_build(out: Path, source: Path, *flags: str) -> Path:
    """``nvcc flags -o out source`` for sm_90 with every warning an error (skip without nvcc)."""
    import subprocess

    proc = subprocess.run([nvcc_or_skip(), *flags, *NVCC_FLAGS, "-o", str(out), str(source)],
                          capture_output=True, text=True, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def nvcc_harness(tmp_path_factory: Any, source: Path) -> Path:
    """A host executable of a ``tests/*_host_harness.cu`` (skip without nvcc or a C++ compiler)."""
    import shutil

    import pytest

    nvcc_or_skip()
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no host C++ compiler for nvcc")
    return nvcc_build(tmp_path_factory.mktemp("harness") / source.stem, source, "-O2")


def nvrtc_cubin(source: str, name: str) -> bytes:
    """The CUDA C ``source`` compiled for sm_90 by NVRTC, the path cupy.RawModule takes (NVRTC
    needs no GPU); asserts a clean log, skips where cupy's NVRTC is not loadable."""
    import pytest

    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # noqa: BLE001 - cupy missing or its NVRTC library not loadable
        pytest.skip(f"cupy's NVRTC binding not importable ({e})")
    try:
        prog = nvrtc.createProgram(source, name, [], [])
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC library not loadable ({e})")
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90"])
        log = nvrtc.getProgramLog(prog)
        assert "warning" not in log.lower(), log
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


class _InstalledKernels(importlib.abc.MetaPathFinder):
    """Import ``kernels`` from the installed distribution (Transformers imports it), not the
    checkout's top-level ``kernels/`` (CUDA sources, shipped as ``gds_persist.kernels``) that
    shadows it while the checkout is on ``sys.path``; where none is installed, nothing changes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "kernels":
            return None
        elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _REPO]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)


def prefer_installed_kernels() -> None:
    """Install :class:`_InstalledKernels` once, ahead of the usual finders."""
    if not any(isinstance(f, _InstalledKernels) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstalledKernels())


def doc_command(doc: str, heading: str, first_output: str) -> tuple[list[str], str]:
    """The first plain block after ``heading`` in ``doc`` (a path under the repository) that
    shows ``$ gds-persist ...`` and what it printed: the command's argv (continuation lines
    joined) and the printed text, which starts with ``first_output``."""
    section = (_REPO / doc).read_text().split(heading, 1)[1]
    block = section.split("```\n", 2)[1].split("```", 1)[0]
    command, _, printed = block.partition("\n" + first_output)

    return (shlex.split(command.removeprefix("$ gds-persist ").replace("\\\n", " ")),
            first_output + printed)


def count_pieces(seg: Any, extents: Any, seen: dict[int, int]) -> None:
    """Check that every piece of the request ``seg`` lies inside it and inside its extent, and
    add its bytes to ``seen`` (extent index -> bytes)."""
    for k, lo, hi in seg.pieces:
        e = extents[k]
        assert seg.lo <= lo < hi <= seg.hi and e.offset <= lo and hi <= e.offset + e.length
        seen[k] += hi - lo


def evict_page_cache(path: str | os.PathLike[str]) -> None:
    """Drop a file's pages from the page cache (every file of a directory): a load after it
    reads from the drive (a file the cache holds is read through it, backends/residency.py)."""
    files = ([os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path)
             else [os.fspath(path)])
    for name in files:
        if os.path.isfile(name):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
