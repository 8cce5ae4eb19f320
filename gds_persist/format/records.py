"""The records a checkpoint is made of, and the names of its files: the format's vocabulary.

Everything here is plain, frozen data. A checkpoint directory holds data files; every byte range
of one storage (an :class:`Extent`) starts at an ``ALIGNMENT``-aligned offset of a data file.
:class:`StorageRecord` and :class:`TensorRecord` describe the tensors the bytes belong to.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

ALIGNMENT = 4096  # every extent starts at a multiple of this; every data file's size is one
MAX_DEPTH = 100  # containers nested deeper than this are refused at save and in a manifest

QUANTIZED_DTYPES = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)


def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype has in a manifest: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d
    for d in (getattr(torch, n) for n in dir(torch))
    if isinstance(d, torch.dtype) and d not in QUANTIZED_DTYPES
}


W = TypeVar("W", bound="Wire")


class Wire:
    """A dataclass record that crosses ranks (as JSON) or phases: :meth:`to_wire` gives a dict by
    field name, :meth:`from_wire` the record again. Fields typed as a ``Wire`` record, a list or
    tuple of them, or a tuple come back as such; everything else must be JSON already."""

    def to_wire(self) -> dict[str, Any]:
        return {name: _to_wire(getattr(self, name)) for name in _field_names(type(self))}

    @classmethod
    def from_wire(cls: type[W], wire: dict[str, Any]) -> W:
        decode = _decoders(cls)
        return cls(**{k: decode[k](v) if k in decode else v for k, v in wire.items()})


def _to_wire(value: Any) -> Any:
    if isinstance(value, Wire):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_DECODERS: dict[type, dict[str, Any]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    if cls not in _FIELD_NAMES:
        _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return _FIELD_NAMES[cls]


def _decoders(cls: type) -> dict[str, Any]:
    """Per field whose JSON form differs from its value: how to turn the one into the other."""
    if cls not in _DECODERS:
        hints = typing.get_type_hints(cls)
        _DECODERS[cls] = {name: d for name, d in ((n, _decoder(h)) for n, h in hints.items())
                          if d is not None}
    return _DECODERS[cls]


def _decoder(hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Wire):
        return hint.from_wire
    if origin in (list, tuple):
        inner = _decoder(args[0]) if args else None
        container = tuple if origin is tuple else list
        if inner is None:
            return container
        return lambda values: container(inner(v) for v in values)
    if origin is dict and len(args) == 2 and _decoder(args[1]) is not None:
        inner = _decoder(args[1])
        return lambda d: {k: inner(v) for k, v in d.items()}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = _decoder(options[0]) if len(options) == 1 else None
        return None if inner is None else (lambda v: None if v is None else inner(v))
    return None


@dataclass(frozen=True)
class StorageRecord(Wire):
    """One distinct block of tensor memory, written as raw bytes; ``device`` is where it lived
    when it was saved (a host snapshot of a CUDA storage records the CUDA device)."""

    nbytes: int
    device: str


@dataclass(frozen=True)
class TensorRecord(Wire):
    """How to rebuild one tensor as a view of a storage (strides and offset in elements)."""

    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool = False
    parameter: bool = False


@dataclass(frozen=True)
class DataFile:
    name: str
    size: int
    dir: int = 0  # 0: the checkpoint directory; k >= 1: Manifest.dirs[k - 1] (format version 2)
    base: int = 0  # 0: this checkpoint's own file; k >= 1: a file of Manifest.bases[k - 1], a
    # sibling checkpoint that physically holds the bytes (format version 4)


@dataclass(frozen=True)
class BaseRef:
    """A sibling checkpoint (same parent directory) whose data files this one refers to, and its
    identity: the SHA-256 of its ``manifest.json``, so a base replaced or moved since is refused
    instead of read (format version 4)."""

    name: str  # a plain directory name inside the parent directory of the checkpoint
    manifest_sha256: str  # 64 lowercase hex digits


@dataclass(frozen=True)
class DataDir:
    """An external data directory (e.g. another NVMe mount): files live in ``root/name/``."""

    root: str  # absolute, normalised; a loader may map it elsewhere (``load(data_dirs=...)``)
    name: str  # plain name with the stripe mark, unique to the save that created it


@dataclass(frozen=True)
class Section:
    """Rank-local state of one rank: ``tree`` is a list node, one subtree per placeholder."""

    rank: int
    tree: Any


CODEC_NONE = "none"  # stored as the raw bytes
CODEC_BLOSC2 = "blosc2"  # stored as one blosc2 chunk (gds_persist.format.codec)
CODECS = (CODEC_NONE, CODEC_BLOSC2)


@dataclass(frozen=True)
class Extent(Wire):
    """Bytes ``[start, start+length)`` of storage ``storage``, at ``offset`` of file ``file``.

    ``crc32c`` is the CRC32C of those (decoded) bytes. Format version 4 adds: ``codec`` (how the
    bytes are stored; ``none``: raw, ``stored_length == length``), ``stored`` and
    ``stored_crc32c`` (length and CRC32C of the bytes on disk when encoded; 0 for ``none``, where
    they equal ``length`` and ``crc32c``), and ``blake3`` (the BLAKE3-128 content hash of the
    decoded bytes as 32 hex digits, or ``""`` when not computed).
    """

    storage: int
    start: int
    length: int
    file: int
    offset: int
    crc32c: int = 0
    codec: str = CODEC_NONE
    stored: int = 0
    stored_crc32c: int = 0
    blake3: str = ""

    @property
    def stored_length(self) -> int:
        """Bytes this extent occupies at ``offset`` (before padding to ``ALIGNMENT``)."""
        return self.length if self.codec == CODEC_NONE else self.stored

    @property
    def stored_checksum(self) -> int:
        """CRC32C of the bytes on disk."""
        return self.crc32c if self.codec == CODEC_NONE else self.stored_crc32c

    @property
    def encoded(self) -> bool:
        return self.codec != CODEC_NONE


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


# --- file and directory names -------------------------------------------------------------------

SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
BLAKE3_128_HEX = re.compile(r"^[0-9a-f]{32}$")
STRIPE_MARK = ".gds-"  # external data directories are named ``<prefix>.gds-<save id>``
STRIPE_DIR_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.gds-[0-9a-f]{6,64}$")


def data_file_name(index: int) -> str:
    return f"data-{index:05d}.bin"


def rank_data_file_name(rank: int, index: int = 0) -> str:
    """The data file a rank writes its share of the replicated state into."""
    return f"data-r{rank:05d}-{index:05d}.bin"


def local_file_name(rank: int, index: int = 0) -> str:
    """The data file holding one rank's rank-local state."""
    return f"local-r{rank:05d}-{index:05d}.bin"


def stripe_dir_name(prefix: str, save_id: str) -> str:
    """Name of the directory a save creates inside an external data directory."""
    name = f"{prefix}{STRIPE_MARK}{save_id}"
    if not STRIPE_DIR_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid data directory name")
    return name
