"""BLAKE3-128 on the device (kernels/blake3.cu): the content hash of incremental saves.

CPU checks (always run where the tools exist): the level schedule of the host driver; the kernel
compiled with nvcc for sm_90 and with NVRTC (the path cupy.RawModule takes); the kernel's own
per-thread code compiled by nvcc as host code and run on the CPU, level by level exactly as
gds_persist/transfer/device_hash.py launches it (tests/blake3_host_harness.cu), compared with the
``blake3`` package; the wheel ships the .cu file. GPU checks (marked ``gpu``): the kernel's value
== the host value for many lengths, alignments and batches; an incremental save of CUDA tensors.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from gds_persist.format.hashing import content_hash
from gds_persist.transfer.device_crc import kernel_source
from gds_persist.transfer.device_hash import (
    CHUNKS_KERNEL,
    KERNEL_FILE,
    PARENTS_KERNEL,
    level_counts,
)

REPO = Path(__file__).resolve().parent.parent
KERNEL = REPO / "kernels" / KERNEL_FILE
HARNESS = REPO / "tests" / "blake3_host_harness.cu"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not on PATH")


def test_level_schedule():
    assert level_counts([0, 1, 1024]) == [[1, 1, 1]]
    assert level_counts([1025, 3 * 1024, 5 * 1024 + 1]) == [[2, 3, 6], [1, 2, 3], [1, 1, 2],
                                                             [1, 1, 1]]


def test_kernel_source_is_found():
    assert CHUNKS_KERNEL in kernel_source(KERNEL_FILE)
    assert PARENTS_KERNEL in kernel_source(KERNEL_FILE)


@needs_nvcc
def test_kernel_compiles_with_nvcc_for_sm90(tmp_path):
    cubin = tmp_path / "blake3.cubin"
    proc = subprocess.run(
        [NVCC, "-cubin", "-arch=sm_90", "-Werror", "all-warnings", "-o", str(cubin), str(KERNEL)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = cubin.read_bytes()
    assert CHUNKS_KERNEL.encode() in data and PARENTS_KERNEL.encode() in data


def test_kernel_compiles_with_nvrtc():
    """The path cupy.RawModule takes on a GPU machine; NVRTC itself needs no GPU."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # noqa: BLE001 - cupy missing or its NVRTC library not loadable
        pytest.skip(f"cupy's NVRTC binding not importable ({e})")
    try:
        prog = nvrtc.createProgram(kernel_source(KERNEL_FILE), KERNEL_FILE, [], [])
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC library not loadable ({e})")
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90"])
        log = nvrtc.getProgramLog(prog)
        assert "warning" not in log.lower(), log
        cubin = nvrtc.getCUBIN(prog)
        assert CHUNKS_KERNEL.encode() in cubin and PARENTS_KERNEL.encode() in cubin
    finally:
        nvrtc.destroyProgram(prog)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc (CUDA toolkit) not on PATH")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no host C++ compiler for nvcc")
    exe = tmp_path_factory.mktemp("harness") / "blake3_harness"
    proc = subprocess.run(
        [NVCC, "-O2", "-arch=sm_90", "-Werror", "all-warnings", "-o", str(exe), str(HARNESS)],
        capture_output=True, text=True, cwd=exe.parent, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return exe


def _hash(exe, path, misalign, *lengths):
    out = subprocess.run([str(exe), "hash", str(path), str(misalign), *map(str, lengths)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_kernel_code_on_cpu_matches_blake3(harness, tmp_path):
    """The kernel's own per-thread code run on the CPU: one piece at a time, every tree shape
    around the power-of-two boundaries, every misalignment of the byte loads."""
    pytest.importorskip("blake3")
    rng = random.Random(3)
    sizes = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 2049, 3072, 3073, 4096, 5 * 1024 + 1,
             7 * 1024, 8 * 1024, 8 * 1024 + 1, 65536, 100_003, 1 << 20]
    path = tmp_path / "data.bin"
    for n in sizes:
        data = rng.randbytes(n)
        path.write_bytes(data)
        for misalign in (0, 1, 3):
            (got,) = _hash(harness, path, misalign)
            assert got == content_hash(data), (n, misalign)


def test_kernel_code_on_cpu_batches_pieces(harness, tmp_path):
    """Many pieces of different tree depths in the same launches, as the save batches them."""
    rng = random.Random(4)
    lengths = [rng.choice([0, 1, 1024, 1025, 4097, rng.randrange(1, 70_000)]) for _ in range(30)]
    data = rng.randbytes(sum(lengths) + 5000)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    got = _hash(harness, path, 0, *lengths)
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    pieces = [data[cuts[i] : cuts[i + 1]] for i in range(len(lengths))] + [data[cuts[-1] :]]
    assert got == [content_hash(p) for p in pieces]


def test_wheel_lists_the_kernel_as_package_data():
    text = (REPO / "pyproject.toml").read_text()
    assert '"gds_persist.kernels" = ["*.cu"]' in text  # blake3.cu ships like crc32c.cu
    assert KERNEL.is_file()


# --- on a GPU -------------------------------------------------------------------------------

def _cuda_or_skip():
    import torch
    from helpers import device_kernel_or_skip

    from gds_persist.transfer.device_hash import device_hash_status

    device_kernel_or_skip(device_hash_status)
    return torch


@pytest.mark.gpu
def test_gpu_kernel_matches_host_hash():
    torch = _cuda_or_skip()
    import gds_persist.transfer.device_hash as dh

    rng = random.Random(5)
    big = torch.randint(0, 256, (48 << 20,), dtype=torch.uint8, device="cuda")
    host = big.cpu().numpy()
    lengths = [0, 1, 64, 1023, 1024, 1025, 4097, (1 << 20) + 3, 16 << 20, 48 << 20]
    lengths += [rng.randrange(1, 48 << 20) for _ in range(10)]
    starts = [rng.randrange(0, (48 << 20) - n + 1) if n < (48 << 20) else 0 for n in lengths]
    pieces = [big[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    got = dh.cuda_hash_many(pieces)  # one batch: every tree depth in the same launches
    want = [content_hash(host[s : s + n]) for s, n in zip(starts, lengths, strict=True)]
    assert got == want
    assert dh._unavailable is None, dh._unavailable


@pytest.mark.gpu
def test_gpu_incremental_save_hashes_on_the_device(tmp_path):
    torch = _cuda_or_skip()
    import gds_persist
    import gds_persist.transfer.device_hash as dh

    frozen = torch.randn(3_000_000, device="cuda")
    trained = torch.randn(1_000_000, device="cuda")
    gds_persist.save({"frozen": frozen, "trained": trained}, tmp_path / "s1", content_hash=True)
    trained += 1
    info = gds_persist.save({"frozen": frozen, "trained": trained}, tmp_path / "s2",
                            base=tmp_path / "s1", compression="lossless")
    assert info.referenced_bytes == frozen.numel() * 4
    got = gds_persist.load(tmp_path / "s2")
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["trained"], trained)
    assert got["frozen"].is_cuda
    m = gds_persist.read_manifest(tmp_path / "s1")
    host = frozen.cpu()
    e = next(e for e in m.extents if e.storage == 0 and e.start == 0)
    assert e.blake3 == content_hash(host.view(torch.uint8)[: e.length].numpy())
    assert dh._unavailable is None, dh._unavailable
