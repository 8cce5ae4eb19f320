"""The safetensors format: an 8-byte little-endian header length, a JSON header (``name ->
dtype, shape, data_offsets``, plus ``__metadata__`` strings) padded to 8 bytes, then the data
buffer. The dtype codes and the header parser live here (format knowledge); writing a file is
:mod:`gds_persist.convert.safetensors`'s, reading one in place :mod:`gds_persist.format.foreign`'s.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import SafetensorsError

MAX_HEADER = 100 << 20  # what safetensors itself accepts

# safetensors dtype codes. The uint16/32/64, complex64 and fnuz float8 codes are known to recent
# safetensors releases only (tested with 0.8).
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class StTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets in the data buffer
    end: int


@dataclass
class StHeader:
    tensors: list[StTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0  # file offset of the data buffer


def looks_like_safetensors(head: bytes, file_size: int) -> bool:
    """Whether the first bytes of a file are a plausible safetensors header start."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 0 < n <= MAX_HEADER and 8 + n <= file_size and head[8:9] == b"{"


def parse_header(read_at: Callable[[int, int], bytes], file_size: int) -> StHeader:
    """The header of a safetensors file of ``file_size`` bytes, every entry checked against the
    file (dtype code known, shape and offsets consistent, inside the data buffer)."""
    if file_size < 8:
        raise SafetensorsError(f"{file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", read_at(0, 8))
    if n > MAX_HEADER or 8 + n > file_size:
        raise SafetensorsError(f"header length {n} is impossible for a {file_size}-byte file")
    try:
        header = json.loads(read_at(8, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    buffer_len = file_size - 8 - n
    tensors = []
    for name, info in header.items():
        try:
            dtype = ST_CODES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"tensor {name!r} has an unsupported dtype or a malformed "
                                   f"entry {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        fits = 0 <= begin <= end <= buffer_len and end - begin == nbytes
        if any(d < 0 for d in shape) or not fits:
            raise SafetensorsError(f"tensor {name!r} has data_offsets {[begin, end]} that do not "
                                   f"fit its shape {list(shape)} and {dtype} or the file")
        tensors.append(StTensor(name, dtype, shape, begin, end))
    return StHeader(tensors, meta if isinstance(meta, dict) else {}, 8 + n)


# --- the Hugging Face layout of a model's weights, as gds_persist writes it -----------------
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CRC_KEY = "gds_persist.crc32c"  # metadata: JSON {stored name: CRC32C as 8 hex digits}
TIED_KEY = "gds_persist.tied"  # metadata: JSON {tied name: the stored name it shares}
_PLACEHOLDER = 0  # the CRC32C field before the data is written: same width as the real one


def shard_names(n: int) -> list[str]:
    """The file names of a model in ``n`` files, as ``save_pretrained`` names them."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def is_model_file(name: str) -> bool:
    """Whether ``name`` is a file of a Hugging Face model's weights (replaced by a new save)."""
    return name == INDEX_NAME or (name.startswith("model") and name.endswith(".safetensors"))


def aligned_header(tensors: list[StTensor], metadata: dict[str, str],
                   crcs: dict[str, int] | None, alignment: int) -> bytes:
    """A file's header - length, JSON, spaces - ending at a multiple of ``alignment``, so the
    data buffer starts aligned. ``crcs`` (None: placeholders of the same width, to size the
    header before the data is written) go into ``metadata`` under :data:`CRC_KEY`."""
    crc_text = {t.name: f"{(crcs or {}).get(t.name, _PLACEHOLDER):08x}" for t in tensors}
    meta = {**metadata, CRC_KEY: json.dumps(crc_text, separators=(",", ":"))}
    header: dict[str, object] = {"__metadata__": meta}
    for t in tensors:
        header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [t.begin, t.end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % alignment)
    if len(raw) > MAX_HEADER:
        raise ValueError(f"the safetensors header would be {len(raw)} bytes, above the "
                         f"{MAX_HEADER}-byte limit of the format; save fewer tensors per file")
    return struct.pack("<Q", len(raw)) + raw


def index_json(total_size: int, weight_map: dict[str, str], metadata: dict[str, str]) -> bytes:
    """``model.safetensors.index.json``: which file holds each stored tensor (as
    ``save_pretrained``'s, it leaves tied names out)."""
    return json.dumps({"metadata": {"total_size": total_size, **metadata},
                       "weight_map": weight_map}, indent=2, sort_keys=True).encode() + b"\n"


def index_files(raw: bytes) -> list[str]:
    """The files an index names, in order of first appearance by sorted file name."""
    try:
        weight_map = json.loads(raw)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise SafetensorsError(f"{INDEX_NAME} is not an index of safetensors files") from None
    if not all(isinstance(f, str) and f.endswith(".safetensors") and "/" not in f
               for f in files):
        raise SafetensorsError(f"{INDEX_NAME} names files outside the directory: {files}")
    return files


def recorded_crcs(header: StHeader) -> dict[str, int] | None:
    """The CRC32C gds_persist recorded for each tensor of a file (None: a file without them)."""
    raw = header.metadata.get(CRC_KEY)
    if raw is None:
        return None
    try:
        return {k: int(v, 16) for k, v in json.loads(raw).items()}
    except (ValueError, TypeError, AttributeError):
        raise SafetensorsError(f"its {CRC_KEY} metadata is malformed") from None


def recorded_ties(header: StHeader) -> dict[str, str]:
    """The tied names a file records: {tied name: stored name}."""
    try:
        ties = json.loads(header.metadata.get(TIED_KEY, "{}"))
        assert isinstance(ties, dict)
        return {str(k): str(v) for k, v in ties.items()}
    except (ValueError, AssertionError):
        raise SafetensorsError(f"its {TIED_KEY} metadata is malformed") from None
