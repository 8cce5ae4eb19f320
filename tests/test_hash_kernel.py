"""BLAKE3-128 on the device (kernels/blake3.cu): the content hash of incremental saves.

CPU checks (always run where the tools exist): the level schedule of the host driver; the kernel
compiled with nvcc for sm_90 and with NVRTC (the path cupy.RawModule takes); the kernel's own
per-thread code compiled by nvcc as host code and run on the CPU, level by level exactly as
gds_persist/transfer/device_hash.py launches it (tests/blake3_host_harness.cu), compared with the
``blake3`` package; the wheel ships the .cu file. GPU checks (marked ``gpu``): the kernel's value
== the host value for many lengths, alignments and batches; an incremental save of CUDA tensors.
"""

from __future__ import annotations

import functools
import random
import subprocess
from pathlib import Path

import pytest
from helpers import (
    device_kernel_or_skip,
    nvcc_build,
    nvcc_harness,
    nvrtc_cubin,
    random_device_pieces,
)

from gds_persist.format.hashing import content_hash
from gds_persist.transfer.device_hash import (
    CHUNKS_KERNEL,
    KERNEL_FILE,
    PARENTS_KERNEL,
    device_hash_status,
    level_counts,
)
from gds_persist.transfer.device_kernels import kernel_source

REPO = Path(__file__).resolve().parent.parent
KERNEL = REPO / "kernels" / KERNEL_FILE
HARNESS = REPO / "tests" / "blake3_host_harness.cu"


def test_level_schedule():
    assert level_counts([0, 1, 1024]) == [[1, 1, 1]]
    assert level_counts([1025, 3 * 1024, 5 * 1024 + 1]) == [[2, 3, 6], [1, 2, 3], [1, 1, 2],
                                                             [1, 1, 1]]


def test_kernel_source_is_found():
    assert CHUNKS_KERNEL in kernel_source(KERNEL_FILE)
    assert PARENTS_KERNEL in kernel_source(KERNEL_FILE)


def test_kernel_compiles_with_nvcc_for_sm90(tmp_path):
    cubin = nvcc_build(tmp_path / "blake3.cubin", KERNEL, "-cubin")
    data = cubin.read_bytes()
    assert CHUNKS_KERNEL.encode() in data and PARENTS_KERNEL.encode() in data


def test_kernel_compiles_with_nvrtc():
    """The path cupy.RawModule takes on a GPU machine; NVRTC itself needs no GPU."""
    cubin = nvrtc_cubin(kernel_source(KERNEL_FILE), KERNEL_FILE)
    assert CHUNKS_KERNEL.encode() in cubin and PARENTS_KERNEL.encode() in cubin


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return nvcc_harness(tmp_path_factory, HARNESS)


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


# an unusable kernel raising its reason: tests/test_kernels.py, for both kernels


def test_without_a_gpu_the_status_says_why():
    import torch

    from gds_persist.transfer.device_hash import device_hash_status

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the reason without one cannot show")
    ok, why = device_hash_status()
    assert not ok
    assert "cupy" in why or "CUDA" in why


# --- on a GPU -------------------------------------------------------------------------------

_cuda_or_skip = functools.partial(device_kernel_or_skip, device_hash_status)


@pytest.mark.gpu
def test_gpu_kernel_matches_host_hash():
    _cuda_or_skip()
    import gds_persist.transfer.device_hash as dh

    pieces = random_device_pieces(48 << 20, [0, 1, 64, 1023, 1024, 1025, 4097, (1 << 20) + 3,
                                             16 << 20, 48 << 20], 10, seed=5)
    got = dh.cuda_hash_many([d for d, _ in pieces])  # one batch: every tree depth at once
    assert got == [content_hash(h) for _, h in pieces]
    assert dh.KERNELS.unavailable is None, dh.KERNELS.unavailable


@pytest.mark.gpu
def test_gpu_incremental_save_hashes_on_the_device(tmp_path):
    torch = _cuda_or_skip()
    import gds_persist
    import gds_persist.transfer.device_hash as dh

    frozen = torch.randn(3_000_000, device="cuda")
    trained = torch.randn(1_000_000, device="cuda")
    gds_persist.save({"frozen": frozen, "trained": trained}, tmp_path / "s1",
                     options=gds_persist.SaveOptions(content_hash=True))
    trained += 1
    info = gds_persist.save({"frozen": frozen, "trained": trained}, tmp_path / "s2",
                            base=tmp_path / "s1",
                            options=gds_persist.SaveOptions(compression="lossless"))
    assert info.referenced_bytes == frozen.numel() * 4
    got = gds_persist.load(tmp_path / "s2")
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["trained"], trained)
    assert got["frozen"].is_cuda
    m = gds_persist.read_manifest(tmp_path / "s1")
    host = frozen.cpu()
    e = next(e for e in m.extents if e.storage == 0 and e.start == 0)
    assert e.blake3 == content_hash(host.view(torch.uint8)[: e.length].numpy())
    assert dh.KERNELS.unavailable is None, dh.KERNELS.unavailable
