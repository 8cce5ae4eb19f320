"""CRC32C on the device (kernels/crc32c.cu) and the combine algebra it rests on.

CPU checks (always run): the GF(2) shift/combine algebra against the host CRC32C; the CPU
reference of the kernel's exact segmentation; the kernel compiled with nvcc for sm_90 and with
NVRTC (the path cupy.RawModule takes); the kernel's own per-thread code compiled by nvcc as host
code and run on the CPU (tests/crc32c_host_harness.cu); the wheel ships the .cu file.
GPU checks (marked ``gpu``): kernel CRC == host CRC for random lengths and alignments.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import (
    device_kernel_or_skip,
    nvcc_build,
    nvcc_harness,
    nvrtc_cubin,
    random_device_pieces,
)

from gds_persist.format.checksum import (
    POLY_REFLECTED,
    X_POW_2K,
    crc32c,
    crc32c_combine,
    crc32c_segmented,
    crc32c_shift,
    gf2_multiply,
    x_pow_8n,
)
from gds_persist.transfer.device_crc import (
    KERNEL_FILE,
    KERNEL_NAME,
    MAX_SEGMENT,
    MIN_SEGMENT,
    device_crc_status,
    segment_bytes_for,
)
from gds_persist.transfer.device_kernels import kernel_source

REPO = Path(__file__).resolve().parent.parent
KERNEL = REPO / "kernels" / "crc32c.cu"
HARNESS = REPO / "tests" / "crc32c_host_harness.cu"
GiB = 1 << 30


# --- the combine algebra, pure Python ---------------------------------------------------------

def test_polynomial_is_castagnoli():
    assert POLY_REFLECTED == 0x82F63B78
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


@pytest.mark.parametrize("len_a", [0, 1, 7, 8, 511, 4095, 4096, 4097, 65535])
@pytest.mark.parametrize("len_b", [0, 1, 3, 8, 9, 4096, 16383, 16384, 16385])
def test_combine_equals_crc_of_concatenation(len_a, len_b):
    rng = random.Random(len_a * 100003 + len_b)
    a, b = rng.randbytes(len_a), rng.randbytes(len_b)
    assert crc32c_combine(crc32c(a), crc32c(b), len_b) == crc32c(a + b)


def test_combine_random_splits():
    rng = random.Random(5)
    for _ in range(200):
        data = rng.randbytes(rng.choice([0, 1, 2, 13, 4095, 4096, 4097, rng.randrange(1, 50000)]))
        cut = rng.randrange(0, len(data) + 1)
        a, b = data[:cut], data[cut:]
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(data)
        # and the shift alone: crc32c continued over zeros == shifted crc ^ crc of the zeros
        assert crc32c_shift(crc32c(a), 100) ^ crc32c(bytes(100)) == crc32c(a + bytes(100))


def test_combine_many_pieces():
    rng = random.Random(11)
    pieces = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(40)]
    whole = b"".join(pieces)
    acc = 0
    for p in pieces:
        acc = crc32c_combine(acc, crc32c(p), len(p))
    assert acc == crc32c(whole)


def _matrix_shift(crc: int, nbytes: int) -> int:
    """An independent implementation: zlib's original GF(2) 32x32 operator-matrix squaring."""

    def times(mat, vec):
        s, i = 0, 0
        while vec:
            if vec & 1:
                s ^= mat[i]
            vec >>= 1
            i += 1
        return s

    def square(mat):
        return [times(mat, mat[n]) for n in range(32)]

    odd = [POLY_REFLECTED] + [1 << n for n in range(31)]  # operator for one zero bit
    even = square(odd)  # two zero bits
    odd = square(even)  # four zero bits
    while nbytes:
        even = square(odd)  # first time: one zero byte
        if nbytes & 1:
            crc = times(even, crc)
        nbytes >>= 1
        if not nbytes:
            break
        odd = square(even)
        if nbytes & 1:
            crc = times(odd, crc)
        nbytes >>= 1
    return crc


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 1 << 31, (1 << 32) + 1, 5 * GiB + 12345,
                                    17 * GiB - 1, (1 << 40) + 3, (1 << 60) + 5])
def test_shift_large_lengths_against_matrix_method(nbytes):
    crc = crc32c(b"gds_persist")
    assert crc32c_shift(crc, nbytes) == _matrix_shift(crc, nbytes)


def test_shift_composes_at_gib_offsets():
    rng = random.Random(3)
    for _ in range(50):
        a, b = rng.randrange(0, 8 * GiB), rng.randrange(0, 8 * GiB)
        crc = rng.getrandbits(32)
        assert crc32c_shift(crc32c_shift(crc, a), b) == crc32c_shift(crc, a + b)
        assert x_pow_8n(a + b) == gf2_multiply(x_pow_8n(a), x_pow_8n(b))


@pytest.mark.slow
def test_combine_across_4gib_of_real_bytes():
    """Several GiB for real (streamed, 64 MiB at a time): head + 4 GiB of zeros + tail."""
    head, tail = b"head-bytes", b"tail"
    zeros = bytes(64 << 20)
    n_zeros = 4 * GiB + 4096 + 1
    streamed = crc32c(head)
    left = n_zeros
    while left:
        chunk = min(left, len(zeros))
        streamed = crc32c(memoryview(zeros)[:chunk], streamed)
        left -= chunk
    streamed = crc32c(tail, streamed)
    zeros_crc = 0
    for chunk_len in (len(zeros),) * (n_zeros // len(zeros)) + (n_zeros % len(zeros),):
        zeros_crc = crc32c_combine(zeros_crc, crc32c(memoryview(zeros)[:chunk_len]), chunk_len)
    combined = crc32c_combine(crc32c(head), zeros_crc, n_zeros)
    combined = crc32c_combine(combined, crc32c(tail), len(tail))
    assert combined == streamed


def test_shift_rejects_bad_lengths():
    with pytest.raises(ValueError, match="negative"):
        x_pow_8n(-1)
    with pytest.raises(ValueError, match="beyond"):
        x_pow_8n(1 << 62)


# --- the kernel's scheme, on the CPU ------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 257, 4095, 4096, 4097, 100_001, 1 << 20])
def test_segmented_reference_matches_host(n):
    data = random.Random(n).randbytes(n)
    assert crc32c_segmented(data, segment_bytes_for(n)) == crc32c(data)
    for seg in ((8, 16) if n <= 4097 else ()) + (264, MAX_SEGMENT, MAX_SEGMENT + 8):
        assert crc32c_segmented(data, seg) == crc32c(data)


def test_segment_size_policy():
    assert segment_bytes_for(0) == MIN_SEGMENT
    assert segment_bytes_for(1) == MIN_SEGMENT
    assert segment_bytes_for(100 * GiB) == MAX_SEGMENT
    for n in (1, 4097, 1 << 26, 1 << 30, 3 * GiB + 5):
        s = segment_bytes_for(n)
        assert s % 8 == 0 and MIN_SEGMENT <= s <= MAX_SEGMENT
    with pytest.raises(ValueError, match="multiple of 8"):
        crc32c_segmented(b"abc", 12)


def test_kernel_table_matches_python():
    src = KERNEL.read_text()
    block = re.search(r"#define GDSP_X_POW_2K_VALUES(.*?)\n\n", src, re.S)
    assert block is not None
    values = [int(v, 16) for v in re.findall(r"0x([0-9a-fA-F]{8})u", block.group(1))]
    assert tuple(values) == X_POW_2K
    assert f"0x{POLY_REFLECTED:08X}u" in src


def test_kernel_source_is_found():
    assert KERNEL_NAME in kernel_source(KERNEL_FILE)
    assert kernel_source(KERNEL_FILE) == KERNEL.read_text()
    with pytest.raises(FileNotFoundError, match="reinstall"):
        kernel_source("no_such_kernel.cu")


def test_kernel_compiles_with_nvcc_for_sm90(tmp_path):
    cubin = nvcc_build(tmp_path / "crc32c.cubin", KERNEL, "-cubin")
    assert KERNEL_NAME.encode() in cubin.read_bytes()  # extern "C": the unmangled symbol


def test_kernel_compiles_with_nvrtc():
    """The path cupy.RawModule takes on a GPU machine; NVRTC itself needs no GPU."""
    assert KERNEL_NAME.encode() in nvrtc_cubin(kernel_source(KERNEL_FILE), KERNEL_FILE)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return nvcc_harness(tmp_path_factory, HARNESS)


def _run(exe, *args):
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_kernel_code_on_cpu_matches_host_crc(harness, tmp_path):
    """The kernel's own per-thread code (slicing-by-8, shift, XOR) run on the CPU by nvcc."""
    rng = random.Random(7)
    sizes = [0, 1, 2, 7, 8, 9, 255, 256, 257, 4095, 4096, 4097, 16383, 16384, 16385, 100_003]
    for n in sizes + [rng.randrange(1, 300_000) for _ in range(6)]:
        data = rng.randbytes(n)
        path = tmp_path / "data.bin"
        path.write_bytes(data)
        for seg in {segment_bytes_for(n), 8, 64, 4096 + 8, MAX_SEGMENT}:
            misalign = rng.randrange(0, 8)
            total, nseg, *own = _run(harness, "crc", path, seg, misalign)
            assert int(total, 16) == crc32c(data), (n, seg, misalign)
            assert int(nseg) == -(-n // seg)
            for k, c in enumerate(own):
                assert int(c, 16) == crc32c(data[k * seg : (k + 1) * seg])


def test_kernel_shift_on_cpu_matches_python(harness):
    rng = random.Random(9)
    for nbytes in [0, 1, 4095, (1 << 32) + 1, 5 * GiB + 7, 17 * GiB - 1, (1 << 60) + 5]:
        crc = rng.getrandbits(32)
        (got,) = _run(harness, "shift", nbytes, crc)
        assert int(got, 16) == crc32c_shift(crc, nbytes)


# --- packaging ----------------------------------------------------------------------------------

def _declared_packages() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


def test_every_subpackage_is_declared():
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "gds_persist").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    declared = set(_declared_packages())
    assert on_disk <= declared, f"add {sorted(on_disk - declared)} to [tool.setuptools] packages"
    assert "gds_persist.kernels" in declared


@pytest.mark.slow
def test_wheel_ships_the_kernel_source(tmp_path):
    """A real ``pip wheel``: the .cu file must be inside, as gds_persist/kernels/crc32c.cu."""
    src = tmp_path / "src"  # build from a copy: setuptools leaves build/ and *.egg-info behind
    src.mkdir()
    for name in ("gds_persist", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "-w", str(tmp_path), "--no-deps",
         "--no-build-isolation", "-q"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    if proc.returncode != 0 and "No module named" in proc.stderr and "setuptools" in proc.stderr:
        pytest.skip("setuptools is not installed in this environment (needed to build the wheel)")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("gds_persist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gds_persist/kernels/crc32c.cu" in names
    assert "gds_persist/kernels/blake3.cu" in names  # the content-hash kernel (test_hash_kernel)
    assert "gds_persist/kernels/__init__.py" in names
    assert "gds_persist/py.typed" in names
    assert not any(n.startswith("kernels/") for n in names)  # no stray top-level package


# --- the host/device dispatch (CPU side) ----------------------------------------------------------

def test_dispatch_of_host_tensors_is_the_host_crc():
    import torch

    from gds_persist.transfer.crc import device_crc32c, device_crc32c_many

    x = torch.randn(1000, 3, dtype=torch.bfloat16)  # any dtype: its bytes are checksummed
    assert device_crc32c(x) == crc32c(x.view(torch.uint8).numpy())
    assert device_crc32c_many([torch.zeros(0, dtype=torch.uint8), torch.arange(7).to(torch.uint8)]
                              ) == [0, crc32c(bytes(range(7)))]


@pytest.mark.parametrize(("module", "many", "status", "cpu_refusal"), [
    ("device_crc", "cuda_crc32c_many", "device_crc_status", "takes CUDA tensors"),
    ("device_hash", "cuda_hash_many", "device_hash_status", "hashing.hash_pieces"),
])
def test_an_unusable_kernel_raises_its_reason(monkeypatch, module, many, status, cpu_refusal):
    import importlib

    import torch

    from gds_persist import BackendError

    m = importlib.import_module(f"gds_persist.transfer.{module}")
    with pytest.raises(TypeError, match=cpu_refusal):
        getattr(m, many)([torch.zeros(4, dtype=torch.uint8)])
    monkeypatch.setattr(m.KERNELS, "unavailable", f"{module} kernel unusable (test)")
    with pytest.raises(BackendError, match=r"unusable \(test\)"):
        getattr(m, many)([])
    assert getattr(m, status)() == (False, f"{module} kernel unusable (test)")


# --- the kernel's stream, with the real cupy (wrapping a stream needs no driver) -----------------

def test_stream_wrapping_uses_the_supported_api_without_warnings():
    """CuPy 14 deprecates ExternalStream: that DeprecationWarning, an error under the suite's
    ``filterwarnings = error``, switched the kernel off on the H200. Stream.from_external is
    used where it exists; this runs under ``-W error``, so any warning fails it."""
    cupy = pytest.importorskip("cupy", reason="cupy not importable (the gpu extra)")
    from gds_persist.transfer.device_kernels import cupy_stream

    if not hasattr(cupy.cuda.Stream, "from_external"):
        pytest.skip(f"cupy {cupy.__version__} has no Stream.from_external (older than 14)")
    ptr = 0x7F00_1234_5000  # any handle: wrapping does not dereference it
    stream = cupy_stream(cupy, ptr, 0)
    assert isinstance(stream, cupy.cuda.Stream)
    assert stream.ptr == ptr
    assert stream.device_id == -1  # the current device: the launch runs under cupy.cuda.Device


def test_stream_wrapping_on_older_cupy_takes_external_stream():
    """CuPy before 14 has no Stream.from_external: the same call takes ExternalStream(ptr,
    device). Only CuPy 14 installs here, so its real ExternalStream stands behind a namespace
    without from_external (and warns, as CuPy 14 does)."""
    import types

    cupy = pytest.importorskip("cupy", reason="cupy not importable (the gpu extra)")
    from gds_persist.transfer.device_kernels import cupy_stream

    older = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=type("Stream", (), {}), ExternalStream=cupy.cuda.ExternalStream))
    with pytest.warns(DeprecationWarning, match="ExternalStream is deprecated"):
        stream = cupy_stream(older, 0x5000, 3)
    assert (stream.ptr, stream.device_id) == (0x5000, 3)


def test_kernel_source_uses_no_deprecated_stream_api():
    source = (REPO / "gds_persist" / "transfer" / "device_kernels.py").read_text()
    assert source.count("ExternalStream(") == 1  # only the older-cupy branch of cupy_stream


# --- on a GPU -------------------------------------------------------------------------------------

_cuda_or_skip = functools.partial(device_kernel_or_skip, device_crc_status)


@pytest.mark.gpu
def test_gpu_kernel_matches_host_random_lengths_and_alignments():
    _cuda_or_skip()
    import gds_persist.transfer.device_crc as cc

    for piece, host in random_device_pieces(64 << 20, [0, 1, 7, 8, 9, 4095, 4096, 4097, 16383,
                                                       16385, (1 << 20) + 3, 64 << 20], 20, 1):
        assert cc.cuda_crc32c(piece) == crc32c(host), (piece.numel(), piece.data_ptr())
    # the kernel ran, not the host fallback
    assert cc.KERNELS.unavailable is None, cc.KERNELS.unavailable


@pytest.mark.gpu
def test_gpu_kernel_many_and_non_byte_dtypes():
    torch = _cuda_or_skip()
    import gds_persist.transfer.device_crc as cc
    from gds_persist.transfer.crc import device_crc32c_many

    rng = random.Random(2)
    pieces = [torch.randint(0, 256, (rng.randrange(0, 300_000),), dtype=torch.uint8, device="cuda")
              for _ in range(50)]
    got = device_crc32c_many(pieces)
    assert got == [crc32c(p.cpu().numpy()) for p in pieces]
    x = torch.randn(1000, 33, device="cuda", dtype=torch.bfloat16)
    assert cc.cuda_crc32c(x) == crc32c(x.cpu().view(torch.uint8).numpy())
    assert cc.KERNELS.unavailable is None, cc.KERNELS.unavailable


@pytest.mark.gpu
def test_gpu_kernel_segment_crcs_match_host():
    """The per-segment output of the kernel, launched by hand (segments_addr != 0)."""
    torch = _cuda_or_skip()
    import numpy as np

    import gds_persist.transfer.device_crc as cc

    n, seg = 1_000_003, 4096
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    segments = -(-n // seg)
    own = torch.zeros(segments, dtype=torch.int32, device="cuda")
    total = torch.zeros(1, dtype=torch.int32, device="cuda")
    (kernel,) = cc.KERNELS.functions(torch.cuda.current_device())
    torch.cuda.synchronize()
    args = (np.uint64(data.data_ptr()), np.uint64(n), np.uint64(seg), np.uint64(total.data_ptr()),
            np.uint64(own.data_ptr()))
    kernel((-(-segments // 256),), (256,), args)
    host = data.cpu().numpy()
    got = [v & 0xFFFFFFFF for v in own.cpu().tolist()]
    assert got == [crc32c(host[k * seg : (k + 1) * seg]) for k in range(segments)]
    assert int(total.item()) & 0xFFFFFFFF == crc32c(host)


@pytest.mark.gpu
def test_gpu_kernel_runs_on_the_callers_stream():
    """Launched on the caller's current (side) stream, after the kernels that produce the bytes:
    a long sleep then a fill are queued on that stream before the CRC is asked for."""
    torch = _cuda_or_skip()
    import gds_persist.transfer.device_crc as cc

    side = torch.cuda.Stream()
    x = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock: a kernel on another stream would
        x[::3] = 9  # read the zeros before this fill
        got = cc.cuda_crc32c(x)
    assert got == crc32c(x.cpu().numpy())
    assert cc.KERNELS.unavailable is None, cc.KERNELS.unavailable
