"""The on-disk format: the only module that knows how a checkpoint directory is laid out.

A checkpoint is a directory holding ``manifest.json`` and one or more data files. Every extent (a
byte range of one storage) starts at a ``ALIGNMENT``-aligned offset of a data file; the gaps are
zeros and every data file's size is a multiple of ``ALIGNMENT``. The manifest is JSON (never a
pickle) and carries a CRC32C of its own body. ``docs/FORMAT.md`` describes the format for other
tools; :func:`parse_manifest` validates everything before any of it is trusted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .checksum import crc32c
from .errors import ManifestError
from .flatten import DTYPES, MAX_DEPTH, StorageRecord, TensorRecord

FORMAT_NAME = "gds_persist"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ALIGNMENT = 4096
CHECKSUM_ALGORITHM = "crc32c"
_MAX_SIZE = 1 << 62  # larger than any file; rejects overflowing sizes early
_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")


@dataclass(frozen=True)
class DataFile:
    name: str
    size: int


@dataclass(frozen=True)
class Extent:
    """Bytes ``[start, start+length)`` of storage ``storage`` live at ``offset`` of file ``file``."""

    storage: int
    start: int
    length: int
    file: int
    offset: int
    crc32c: int = 0


@dataclass
class Manifest:
    files: list[DataFile]
    storages: list[StorageRecord]
    tensors: list[TensorRecord]
    extents: list[Extent]
    tree: Any
    writer: dict[str, Any] = field(default_factory=dict)  # backend, reason, world size: for humans
    alignment: int = ALIGNMENT

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def data_file_name(index: int) -> str:
    return f"data-{index:05d}.bin"


def dump_manifest(m: Manifest) -> bytes:
    body = {
        "alignment": m.alignment,
        "checksum": CHECKSUM_ALGORITHM,
        "byteorder": "little",
        "files": [asdict(f) for f in m.files],
        "storages": [asdict(s) for s in m.storages],
        "tensors": [asdict(t) for t in m.tensors],
        "extents": [asdict(e) for e in m.extents],
        "tree": m.tree,
        "writer": m.writer,
    }
    text = _canonical(body)
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "body_crc32c": crc32c(text),
        "body": body,
    }
    return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and fully validate a manifest; ``where`` names it in every error."""
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError, huge ints, deep nesting
        raise ManifestError(f"{where}: not valid JSON ({e}); the manifest is corrupted") from e
    _require(isinstance(doc, dict) and doc.get("format") == FORMAT_NAME, where,
             f"not a {FORMAT_NAME} manifest")
    version = doc.get("version")
    _require(version == FORMAT_VERSION, where,
             f"format version {version!r} is not supported by this gds_persist (reads version "
             f"{FORMAT_VERSION}); upgrade gds_persist to read it")
    body = doc.get("body")
    _require(isinstance(body, dict), where, "has no body")
    _require(crc32c(_canonical(body)) == doc.get("body_crc32c"), where,
             "body checksum mismatch; the manifest was corrupted or edited")
    return _ManifestValidator(body, where).build()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in a manifest")


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ManifestError(f"{where}: {message}")


def _is_int(v: Any, lo: int = 0, hi: int = _MAX_SIZE) -> bool:
    return type(v) is int and lo <= v <= hi


class _ManifestValidator:
    """Checks every field of a manifest body, so later stages can trust indices and sizes."""

    def __init__(self, body: dict[str, Any], where: str):
        self.body = body
        self.where = where

    def fail(self, message: str) -> ManifestError:
        return ManifestError(f"{self.where}: {message}")

    def records(self, key: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        items = self.body.get(key)
        if not isinstance(items, list):
            raise self.fail(f"'{key}' must be a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict) or set(item) != set(fields):
                raise self.fail(f"{key}[{i}] must have exactly the fields {sorted(fields)}")
        return items

    def build(self) -> Manifest:
        b = self.body
        if b.get("alignment") != ALIGNMENT or b.get("checksum") != CHECKSUM_ALGORITHM:
            raise self.fail(f"unsupported alignment/checksum {b.get('alignment')}/{b.get('checksum')}")
        if b.get("byteorder") != "little":
            raise self.fail("only little-endian checkpoints are supported")
        files = [self.file(i, f) for i, f in enumerate(self.records("files", {"name": 0, "size": 0}))]
        storages = [self.storage(i, s) for i, s in enumerate(
            self.records("storages", {"nbytes": 0, "device": 0}))]
        tensor_fields = {k: 0 for k in TensorRecord.__dataclass_fields__}
        tensors = [self.tensor(i, t, storages) for i, t in enumerate(
            self.records("tensors", tensor_fields))]
        extent_fields = {k: 0 for k in Extent.__dataclass_fields__}
        extents = [self.extent(i, e, files, storages) for i, e in enumerate(
            self.records("extents", extent_fields))]
        self.coverage(extents, storages)
        self.tree(b.get("tree"), len(tensors), depth=0)
        writer = b.get("writer")
        if not isinstance(writer, dict):
            raise self.fail("'writer' must be an object")
        return Manifest(files, storages, tensors, extents, b["tree"], writer)

    def file(self, i: int, f: dict[str, Any]) -> DataFile:
        name = f["name"]
        if not isinstance(name, str) or not _SAFE_FILE_NAME.match(name) or name == "manifest.json":
            raise self.fail(f"files[{i}] name {name!r} is not a plain file name inside the checkpoint")
        if not _is_int(f["size"]) or f["size"] % ALIGNMENT:
            raise self.fail(f"files[{i}] size {f['size']!r} is not a non-negative multiple of {ALIGNMENT}")
        return DataFile(name, f["size"])

    def storage(self, i: int, s: dict[str, Any]) -> StorageRecord:
        if not _is_int(s["nbytes"]) or not isinstance(s["device"], str):
            raise self.fail(f"storages[{i}] has a bad size or device: {s}")
        return StorageRecord(s["nbytes"], s["device"])

    def tensor(self, i: int, t: dict[str, Any], storages: list[StorageRecord]) -> TensorRecord:
        ok = (
            _is_int(t["storage"], 0, len(storages) - 1)
            and t["dtype"] in DTYPES
            and isinstance(t["shape"], list) and all(_is_int(d, 0, 1 << 48) for d in t["shape"])
            and isinstance(t["stride"], list) and len(t["stride"]) == len(t["shape"])
            and all(_is_int(s, 0, 1 << 48) for s in t["stride"])
            and _is_int(t["storage_offset"])
            and isinstance(t["requires_grad"], bool) and isinstance(t["parameter"], bool)
        )
        if not ok:
            raise self.fail(f"tensors[{i}] is malformed: {t}")
        record = TensorRecord(t["storage"], t["dtype"], tuple(t["shape"]), tuple(t["stride"]),
                              t["storage_offset"], t["requires_grad"], t["parameter"])
        if math.prod(record.shape) > _MAX_SIZE:
            raise self.fail(f"tensors[{i}] has more elements than any tensor can: {t['shape']}")
        if math.prod(record.shape):
            last = record.storage_offset + sum((d - 1) * s for d, s in zip(record.shape, record.stride))
            needed = (last + 1) * DTYPES[record.dtype].itemsize
            if needed > storages[record.storage].nbytes:
                raise self.fail(f"tensors[{i}] reaches byte {needed} of a {storages[record.storage].nbytes}-byte storage")
        return record

    def extent(self, i: int, e: dict[str, Any], files: list[DataFile],
               storages: list[StorageRecord]) -> Extent:
        if not all(_is_int(e[k]) for k in ("storage", "start", "length", "file", "offset")):
            raise self.fail(f"extents[{i}] has a negative, non-integer or overflowing field: {e}")
        if e["storage"] >= len(storages) or e["file"] >= len(files):
            raise self.fail(f"extents[{i}] refers to a storage or file that does not exist: {e}")
        if e["offset"] % ALIGNMENT:
            raise self.fail(f"extents[{i}] offset {e['offset']} is not {ALIGNMENT}-aligned")
        if e["offset"] + e["length"] > files[e["file"]].size:
            raise self.fail(f"extents[{i}] ends at {e['offset'] + e['length']}, beyond "
                            f"{files[e['file']].name} ({files[e['file']].size} bytes)")
        if e["start"] + e["length"] > storages[e["storage"]].nbytes:
            raise self.fail(f"extents[{i}] ends beyond its storage's {storages[e['storage']].nbytes} bytes")
        if not _is_int(e["crc32c"], 0, 0xFFFFFFFF):
            raise self.fail(f"extents[{i}] crc32c {e['crc32c']!r} is not a 32-bit value")
        return Extent(**e)

    def coverage(self, extents: list[Extent], storages: list[StorageRecord]) -> None:
        """Each storage must be covered exactly once, with no gap and no overlap."""
        by_storage: dict[int, list[Extent]] = {}
        for e in extents:
            by_storage.setdefault(e.storage, []).append(e)
        for index, storage in enumerate(storages):
            covered = 0
            for e in sorted(by_storage.get(index, []), key=lambda e: e.start):
                if e.start != covered:
                    raise self.fail(f"storage {index} has a gap or overlap at byte {covered}")
                covered += e.length
            if covered != storage.nbytes:
                raise self.fail(f"storage {index} is {storage.nbytes} bytes but extents cover {covered}")

    def tree(self, node: Any, n_tensors: int, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise self.fail(f"tree is nested too deeply (more than {MAX_DEPTH} levels)")
        if node is None or isinstance(node, (bool, int, str)):
            return
        if isinstance(node, float):
            if not math.isfinite(node):
                raise self.fail("tree holds a non-finite float outside a float node")
            return
        if not isinstance(node, dict):
            raise self.fail(f"tree holds a {type(node).__name__}")
        kind = node.get("t")
        if kind == "tensor" and set(node) == {"t", "i"} and _is_int(node["i"], 0, n_tensors - 1):
            return
        if kind == "float" and set(node) == {"t", "v"} and node["v"] in ("inf", "-inf", "nan"):
            return
        if kind in ("list", "tuple") and set(node) == {"t", "v"} and isinstance(node["v"], list):
            for v in node["v"]:
                self.tree(v, n_tensors, depth + 1)
            return
        if kind in ("dict", "odict") and {"t", "k", "v"} <= set(node) <= {"t", "k", "v", "meta"}:
            keys, values = node["k"], node["v"]
            if (isinstance(keys, list) and isinstance(values, list) and len(keys) == len(values)
                    and all(isinstance(k, str) or type(k) is int for k in keys)):
                for v in values + ([node["meta"]] if "meta" in node else []):
                    self.tree(v, n_tensors, depth + 1)
                return
        raise self.fail(f"tree node {str(node)[:80]!r} is not valid")
