"""The lossless codec of encoded extents (format version 4): what an extent with
``"codec": "blosc2"`` holds on disk, and how it is encoded and decoded.

An encoded extent is one **blosc2 chunk** (the C-Blosc2 1.x/2.x chunk format: a self-describing
header with the uncompressed size, the type size, the filters and the codec, then the blocks), as
``blosc2_compress_ctx`` writes it and ``blosc2_decompress_ctx`` reads it. gds_persist writes it
with the **bit-shuffle filter and LZ4** (clevel 1) and the element size of the storage's dtype as
the type size (2 for bf16/fp16, 4 for fp32, ...): measured on trained bf16 weights and fp32
AdamW state (docs/FORMAT.md, "Compression") as the only configuration that compresses faster than
a ~2.3 GB/s drive on one core (2.5-3.4 GB/s; decode 4-5 GB/s) at ratios 1.13-1.32 on dense
tensors (5.7x on never-updated embedding rows). ZSTD variants compress 4-11% smaller but 2-5x
slower. A reader needs only the chunk header to decode, so other filters/codecs decode the same.

Storages are cut into units of at most :data:`UNIT_BYTES` (:mod:`gds_persist.saving.units`) and
each unit is one extent, encoded on its own. Units shorter than :data:`COMPRESS_MIN`, and those the
codec would not shrink by a whole ``ALIGNMENT`` block, are stored raw (``"codec": "none"``).

python-blosc2 holds the GIL while it compresses unless told otherwise: gds_persist calls its
``blosc2.set_releasegil(True)`` (process-wide; it then releases the GIL in ``compress2`` and
``decompress2`` too, each call with its own context) so the I/O threads compress units in
parallel, one blosc2 thread each (measured on 2 cores: 4.3 GB/s from two threads against 3.2
from one call with two blosc2 threads, and CRCs and writes of other units run meanwhile).
It refuses a 0-byte destination, so empty units are never encoded.
"""

from __future__ import annotations

from typing import Any

from .records import ALIGNMENT, CODEC_BLOSC2, CODEC_NONE, align_up

UNIT_BYTES = 16 << 20  # one extent (and one encoded chunk) per this many bytes of a storage
COMPRESS_MIN = 64 << 10  # smaller units are stored raw: nothing to gain once padded to 4 KiB
CLEVEL = 1
DESCRIPTION = "blosc2 bit-shuffle + LZ4 (clevel 1, typesize = element size)"

__all__ = ["CLEVEL", "CODEC_BLOSC2", "CODEC_NONE", "COMPRESS_MIN", "DESCRIPTION", "UNIT_BYTES",
           "available", "decode", "encode", "worth_storing"]


_gil_released = False


def _blosc2() -> Any:
    global _gil_released
    import blosc2

    if not _gil_released:
        blosc2.set_releasegil(True)
        _gil_released = True
    return blosc2


def available() -> tuple[bool, str]:
    """Whether the codec can be used here, and why not (never raises)."""
    try:
        blosc2 = _blosc2()
    except ImportError as e:
        return False, (f"python-blosc2 is not importable ({e}); install it: "
                       "pip install blosc2")
    return True, f"python-blosc2 {blosc2.__version__}"


def encode(data: Any, typesize: int, nthreads: int = 1) -> bytes:
    """One blosc2 chunk holding ``data`` (any contiguous buffer of at least 1 byte)."""
    blosc2 = _blosc2()
    typesize = min(max(1, int(typesize)), 255)
    return blosc2.compress2(data, typesize=typesize, clevel=CLEVEL, codec=blosc2.Codec.LZ4,
                            filters=[blosc2.Filter.BITSHUFFLE], filters_meta=[0],
                            nthreads=max(1, int(nthreads)))


def decode(stored: Any, out: Any, nthreads: int = 1) -> None:
    """Decode the blosc2 chunk ``stored`` into ``out`` (a writable contiguous buffer of exactly
    the decoded size). Raises ``ValueError`` when the chunk is not one of that size (corrupted
    stored bytes)."""
    blosc2 = _blosc2()
    view = memoryview(out).cast("B")
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(stored)
    except Exception as e:  # noqa: BLE001 - whatever the library raises for a bad header
        raise ValueError(f"not a blosc2 chunk ({type(e).__name__}: {e})") from None
    if nbytes != view.nbytes or cbytes != memoryview(stored).nbytes:
        raise ValueError(f"blosc2 chunk header says {nbytes} bytes from {cbytes} stored; "
                         f"expected {view.nbytes} from {memoryview(stored).nbytes}")
    try:
        blosc2.decompress2(stored, dst=view, nthreads=max(1, int(nthreads)))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"blosc2 could not decode it ({type(e).__name__}: {e})") from None


def worth_storing(raw_length: int, encoded_length: int) -> bool:
    """Store the encoded form only when it saves at least one ``ALIGNMENT`` block on disk."""
    return 0 < encoded_length and align_up(encoded_length, ALIGNMENT) < align_up(raw_length,
                                                                                 ALIGNMENT)
