"""The host CRC32C: awscrt (aws-checksums) when installed, the ``crc32c`` package otherwise.

Both must give the format's CRC32C for every buffer the engine hands them (bytes, slices of
numpy arrays and memoryviews, mmaps, continuation values, lengths past 2**32), so a checkpoint
written with one verifies with the other.
"""

from __future__ import annotations

import importlib.util
import mmap
import random
import subprocess
import sys

import crc32c as sse42
import numpy as np
import pytest

from gds_persist.format import checksum
from gds_persist.format.checksum import crc32c


def _buffers() -> list[object]:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 3_000_001, dtype=np.uint8)
    mapped = mmap.mmap(-1, 8192)
    mapped[:11] = b"hello world"
    floats = data[:3_000_000].view(np.float32)
    return [b"", b"a", bytes(range(256)) * 33, bytearray(b"xyz" * 4099), data, data[7:],
            data[1 : 1_048_577], memoryview(data)[13:999_999], floats[1:5000], mapped,
            np.frombuffer(bytes(64), dtype=np.uint8)]


def test_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_the_declared_fast_crc_is_the_one_used():
    # pyproject.toml declares awscrt: a fresh install checksums with it
    assert importlib.util.find_spec("awscrt") is not None
    assert checksum.IMPLEMENTATION == "awscrt"


@pytest.mark.parametrize("value", [0, 1, 0x12345678, 0xFFFFFFFF])
def test_agrees_with_the_sse42_package(value):
    for data in _buffers():
        assert crc32c(data, value) == sse42.crc32c(data, value), (type(data), value)


def test_random_splits_continue_across_calls():
    rng = random.Random(8)
    data = rng.randbytes(200_000)
    for _ in range(50):
        cut = rng.randrange(0, len(data) + 1)
        view = memoryview(data)
        assert crc32c(view[cut:], crc32c(view[:cut])) == sse42.crc32c(data)


def test_combine_in_c_agrees_with_the_algebra():
    rng = random.Random(9)
    lengths = [0, 1, 7, 4096, 16 << 20, (1 << 32) + 3, 1 << 40, (1 << 61) - 1]
    lengths += [rng.randrange(1, 1 << 45) for _ in range(200)]
    for n in lengths:
        a, b = rng.getrandbits(32), rng.getrandbits(32)
        assert checksum.crc32c_combine(a, b, n) == checksum.crc32c_shift(a, n) ^ b, n
    with pytest.raises(ValueError, match="negative"):
        checksum.crc32c_combine(1, 2, -1)


def test_lengths_past_two_to_the_32():
    # calloc'd zeros map the zero page: 4 GiB read, none allocated
    zeros = np.zeros((1 << 32) + 4099, dtype=np.uint8)
    assert crc32c(zeros) == sse42.crc32c(zeros)


def test_refuses_what_is_not_bytes():
    with pytest.raises(TypeError, match="not str"):
        crc32c("123456789")
    with pytest.raises(ValueError, match="contiguous"):
        crc32c(np.arange(100, dtype=np.uint8)[::2])


def test_without_awscrt_the_sse42_package_checksums():
    code = ("import sys; sys.modules['awscrt'] = None\n"
            "from gds_persist.format import checksum as c\n"
            "print(c.IMPLEMENTATION, hex(c.crc32c(b'123456789')),"
            " c.crc32c_combine(c.crc32c(b'1234'), c.crc32c(b'56789'), 5) == 0xE3069283)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["crc32c", "0xe3069283", "True"]
