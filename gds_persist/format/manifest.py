"""The manifest: what a checkpoint directory holds, written and read (parsed and fully validated).

A checkpoint is a directory holding ``manifest.json`` and one or more data files. Every extent (a
byte range of one storage) starts at a ``ALIGNMENT``-aligned offset of a data file; the gaps are
zeros and every data file's size is a multiple of ``ALIGNMENT``. The manifest is JSON (never a
pickle) and carries a CRC32C of its own body. ``docs/FORMAT.md`` describes the format for other
tools; :func:`parse_manifest` validates everything before any of it is trusted. The records it
lists are in :mod:`.records`, the tree encoding of the state dict's structure in :mod:`.tree`.

Version 2 (written only when a checkpoint uses it; version 1 otherwise, so older readers keep
reading plain checkpoints) adds, for data-parallel saves (``docs/DISTRIBUTED.md``):

* ``dirs``: external data directories ``{"root": ABSOLUTE_PATH, "name": PLAIN_NAME}``; a file's
  ``dir`` is 0 for the checkpoint directory itself and ``k`` for ``dirs[k-1]``, whose files live in
  ``root/name/``. ``name`` is a plain name carrying the save's stripe mark (``*.gds-<id>``), so a
  manifest can only point into directories a save created, and :func:`data_file_path` refuses any
  file whose real path (symlinks resolved) leaves its directory.
* ``sections``: rank-local state. The main tree holds ``{"t": "local", "i": j}`` placeholders;
  section ``{"rank": r, "tree": {"t": "list", "v": [subtree_0, ...]}}`` holds rank ``r``'s subtree
  for each placeholder ``j``. Tensor indices are global, as in the main tree.

Version 3 (written only when a tree holds one of them) is version 2 plus the extra leaf node
kinds of :mod:`.leaves` (numpy arrays and scalars, bytes, paths, enums, typed containers,
opt-in pickles), so that a reader which predates them says "upgrade" instead of failing on a node.

Version 4 (written only when a checkpoint uses one of them) is version 3 plus:

* ``bases``: sibling checkpoints (same parent directory, plain names) whose data files this one
  refers to, each with the SHA-256 of its ``manifest.json``; a file's ``base`` is 0 for its own
  files and ``k`` for a file of ``bases[k-1]`` (an incremental save);
* per extent ``codec`` / ``stored`` / ``stored_crc32c`` (an extent stored encoded by the lossless
  codec of :mod:`.codec`) and ``blake3`` (the content hash of :mod:`.hashing`).
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from . import leaves, records
from . import tree as _tree
from .checksum import crc32c
from .records import (
    ALIGNMENT,
    BLAKE3_128_HEX,
    CODEC_NONE,
    CODECS,
    DTYPES,
    SAFE_FILE_NAME,
    SHA256_HEX,
    STRIPE_DIR_NAME,
    STRIPE_MARK,
)

FORMAT_NAME = "gds_persist"
FORMAT_VERSION = 4  # the newest version written; each checkpoint gets the oldest that holds it
READABLE_VERSIONS = (1, 2, 3, 4)
REFERENCES_VERSION = 4  # bases, encoded extents, content hashes
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "crc32c"
_MAX_SIZE = 1 << 62  # larger than any file; rejects overflowing sizes early


@dataclass
class Manifest:
    files: list[records.DataFile]
    storages: list[records.StorageRecord]
    tensors: list[records.TensorRecord]
    extents: list[records.Extent]
    tree: Any
    writer: dict[str, Any] = field(default_factory=dict)  # backend, reason, world size: for humans
    alignment: int = ALIGNMENT
    dirs: list[records.DataDir] = field(default_factory=list)  # version 2
    sections: list[records.Section] = field(default_factory=list)  # version 2
    bases: list[records.BaseRef] = field(default_factory=list)  # version 4

    @property
    def total_bytes(self) -> int:
        """Bytes of this checkpoint's own data files (not those of its bases)."""
        return sum(f.size for f in self.files if not f.base)

    @property
    def referenced_bytes(self) -> int:
        """Decoded bytes of the extents that live in the data files of base checkpoints."""
        return sum(e.length for e in self.extents if self.files[e.file].base)

    @property
    def version(self) -> int:
        """The format version this manifest needs: 4 only if it refers to base checkpoints or
        has an encoded or content-hashed extent, else 3 only if a tree holds an extra leaf node,
        else 2 only if it uses a version-2 field, else 1."""
        if (self.bases or any(f.base for f in self.files)
                or any(e.codec != CODEC_NONE or e.blake3 for e in self.extents)):
            return REFERENCES_VERSION
        if any(_tree.uses_leaves(t) for t in (self.tree, *(s.tree for s in self.sections))):
            return leaves.VERSION
        uses_v2 = self.dirs or self.sections or any(f.dir for f in self.files)
        return 2 if uses_v2 or _tree.has_locals(self.tree) else 1


def dump_manifest(m: Manifest) -> bytes:
    version = m.version
    body = {
        "alignment": m.alignment,
        "checksum": CHECKSUM_ALGORITHM,
        "byteorder": "little",
        "files": [_file_fields(f, version) for f in m.files],
        "storages": [_fields(s) for s in m.storages],
        "tensors": [_fields(t) for t in m.tensors],
        "extents": [_extent_fields(e, version) for e in m.extents],
        "tree": m.tree,
        "writer": m.writer,
    }
    if version >= 2:
        body["dirs"] = [_fields(d) for d in m.dirs]
        body["sections"] = [_fields(sec) for sec in m.sections]
    if version >= REFERENCES_VERSION:
        body["bases"] = [_fields(b) for b in m.bases]
    text = canonical(body)
    # The document is {"format", "version", "body_crc32c", "body"} with the body spliced in as
    # its canonical text: encoded once, by the C encoder (an indented dump runs the pure-Python
    # encoder and holds the GIL for tens of ms per save, stalling a training loop that
    # checkpoints from a background thread).
    head = json.dumps({"format": FORMAT_NAME, "version": version, "body_crc32c": crc32c(text)})
    return head[:-1].encode() + b', "body": ' + text + b"}\n"


def _fields(record: Any) -> dict[str, Any]:
    """A record's fields (ints, strs, tuples, JSON trees): ``asdict`` without its deep copy."""
    return dict(vars(record))


_EXTENT_V1 = ("storage", "start", "length", "file", "offset", "crc32c")


def _file_fields(f: records.DataFile, version: int) -> dict[str, Any]:
    if version >= REFERENCES_VERSION:
        return _fields(f)
    if version >= 2:
        return {"name": f.name, "size": f.size, "dir": f.dir}
    return {"name": f.name, "size": f.size}


def _extent_fields(e: records.Extent, version: int) -> dict[str, Any]:
    if version < REFERENCES_VERSION:
        return {k: getattr(e, k) for k in _EXTENT_V1}
    out = _fields(e)
    out["stored"], out["stored_crc32c"] = e.stored_length, e.stored_checksum
    return out


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes of a manifest body that its ``body_crc32c`` covers."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and fully validate a manifest; ``where`` names it in every error."""
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError, huge ints, deep nesting
        raise ManifestError(f"{where}: not valid JSON ({e}); the manifest is corrupted") from e
    _require(
        isinstance(doc, dict) and doc.get("format") == FORMAT_NAME,
        where,
        f"not a {FORMAT_NAME} manifest",
    )
    version = doc.get("version")
    _require(
        type(version) is int and version in READABLE_VERSIONS,
        where,
        f"format version {version!r} is not supported by this gds_persist (reads versions "
        f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade gds_persist to read it",
    )
    body = doc.get("body")
    _require(isinstance(body, dict), where, "has no body")
    _require(
        crc32c(canonical(body)) == doc.get("body_crc32c"),
        where,
        "body checksum mismatch; the manifest was corrupted or edited",
    )
    return _ManifestValidator(body, where, version).build()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in a manifest")


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ManifestError(f"{where}: {message}")


def _is_int(v: Any, lo: int = 0, hi: int = _MAX_SIZE) -> bool:
    return type(v) is int and lo <= v <= hi


class _ManifestValidator:
    """Checks every field of a manifest body, so later stages can trust indices and sizes."""

    def __init__(self, body: dict[str, Any], where: str, version: int = 1):
        self.body = body
        self.where = where
        self.version = version
        self.n_local = 0  # placeholders seen in the main tree (version 2)

    def fail(self, message: str) -> ManifestError:
        return ManifestError(f"{self.where}: {message}")

    def entries(self, key: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
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
            raise self.fail(
                f"unsupported alignment/checksum {b.get('alignment')}/{b.get('checksum')}"
            )
        if b.get("byteorder") != "little":
            raise self.fail("only little-endian checkpoints are supported")
        dirs = self.dirs() if self.version >= 2 else []
        bases = self.bases() if self.version >= REFERENCES_VERSION else []
        file_fields = {"name": 0, "size": 0, **({"dir": 0} if self.version >= 2 else {}),
                       **({"base": 0} if self.version >= REFERENCES_VERSION else {})}
        files = [
            self.file(i, f, len(dirs), len(bases))
            for i, f in enumerate(self.entries("files", file_fields))
        ]
        storages = [
            self.storage(i, s)
            for i, s in enumerate(self.entries("storages", {"nbytes": 0, "device": 0}))
        ]
        tensor_fields = {k: 0 for k in records.TensorRecord.__dataclass_fields__}
        tensors = [
            self.tensor(i, t, storages)
            for i, t in enumerate(self.entries("tensors", tensor_fields))
        ]
        extent_fields = ({k: 0 for k in records.Extent.__dataclass_fields__}
                         if self.version >= REFERENCES_VERSION else dict.fromkeys(_EXTENT_V1, 0))
        extents = [
            self.extent(i, e, files, storages)
            for i, e in enumerate(self.entries("extents", extent_fields))
        ]
        self.coverage(extents, storages)
        self.n_local = self.tree(b.get("tree"), len(tensors), 0 if self.version >= 2 else None)
        sections = self.sections(len(tensors)) if self.version >= 2 else []
        writer = b.get("writer")
        if not isinstance(writer, dict):
            raise self.fail("'writer' must be an object")
        if len({(f.base, f.dir, f.name) for f in files}) != len(files):
            raise self.fail("two files have the same name in the same directory")
        return Manifest(
            files, storages, tensors, extents, b["tree"], writer, ALIGNMENT, dirs, sections, bases
        )

    def bases(self) -> list[records.BaseRef]:
        out = []
        for i, d in enumerate(self.entries("bases", {"name": 0, "manifest_sha256": 0})):
            name, digest = d["name"], d["manifest_sha256"]
            if (not isinstance(name, str) or not SAFE_FILE_NAME.match(name)
                    or STRIPE_MARK in name or ".tmp-" in name or ".old-" in name
                    or ".del-" in name):
                raise self.fail(
                    f"bases[{i}] name {name!r} is not the plain name of a sibling checkpoint "
                    "directory (references outside the checkpoint's parent directory are "
                    "refused)")
            if not isinstance(digest, str) or not SHA256_HEX.match(digest):
                raise self.fail(f"bases[{i}] manifest_sha256 {digest!r} is not 64 hex digits")
            out.append(records.BaseRef(name, digest))
        if len({b.name for b in out}) != len(out):
            raise self.fail("'bases' lists a checkpoint twice")
        return out

    def file(self, i: int, f: dict[str, Any], n_dirs: int = 0,
             n_bases: int = 0) -> records.DataFile:
        name = f["name"]
        if not isinstance(name, str) or not SAFE_FILE_NAME.match(name) or name == MANIFEST_NAME:
            raise self.fail(
                f"files[{i}] name {name!r} is not a plain file name inside the checkpoint"
            )
        if not _is_int(f["size"]) or f["size"] % ALIGNMENT:
            raise self.fail(
                f"files[{i}] size {f['size']!r} is not a non-negative multiple of {ALIGNMENT}"
            )
        directory = f.get("dir", 0)
        if not _is_int(directory, 0, n_dirs):
            raise self.fail(
                f"files[{i}] dir {directory!r} is not 0 (the checkpoint directory) or "
                f"one of the {n_dirs} data directories"
            )
        base = f.get("base", 0)
        if not _is_int(base, 0, n_bases):
            raise self.fail(f"files[{i}] base {base!r} is not 0 (this checkpoint) or one of "
                            f"the {n_bases} base checkpoints")
        if base and directory:
            raise self.fail(f"files[{i}] of a base checkpoint must be in its directory (dir 0)")
        return records.DataFile(name, f["size"], directory, base)

    def dirs(self) -> list[records.DataDir]:
        out = []
        for i, d in enumerate(self.entries("dirs", {"root": 0, "name": 0})):
            root, name = d["root"], d["name"]
            if (
                not isinstance(root, str)
                or not root.startswith("/")
                or "\x00" in root
                or posixpath.normpath(root) != root
                or len(root) > 4096
            ):
                raise self.fail(f"dirs[{i}] root {root!r} is not an absolute, normalised path")
            if not isinstance(name, str) or not STRIPE_DIR_NAME.match(name):
                raise self.fail(
                    f"dirs[{i}] name {name!r} is not a plain data directory name "
                    f"(NAME{STRIPE_MARK}<save id>)"
                )
            out.append(records.DataDir(root, name))
        if len(set(out)) != len(out):
            raise self.fail("'dirs' lists a directory twice")
        return out

    def sections(self, n_tensors: int) -> list[records.Section]:
        out = []
        for i, sec in enumerate(self.entries("sections", {"rank": 0, "tree": 0})):
            tree = sec["tree"]
            if not _is_int(sec["rank"], 0, 1 << 24):
                raise self.fail(f"sections[{i}] rank {sec['rank']!r} is not a rank")
            items = _tree.list_items(tree)
            if items is None or len(items) != self.n_local:
                raise self.fail(
                    f"sections[{i}] tree must be a list of {self.n_local} subtrees, "
                    "one per rank-local placeholder"
                )
            self.tree(tree, n_tensors)
            out.append(records.Section(sec["rank"], tree))
        if len({s.rank for s in out}) != len(out):
            raise self.fail("two sections belong to the same rank")
        return out

    def storage(self, i: int, s: dict[str, Any]) -> records.StorageRecord:
        if not _is_int(s["nbytes"]) or not isinstance(s["device"], str):
            raise self.fail(f"storages[{i}] has a bad size or device: {s}")
        return records.StorageRecord(s["nbytes"], s["device"])

    def tensor(
        self, i: int, t: dict[str, Any], storages: list[records.StorageRecord]
    ) -> records.TensorRecord:
        ok = (
            _is_int(t["storage"], 0, len(storages) - 1)
            and t["dtype"] in DTYPES
            and isinstance(t["shape"], list)
            and all(_is_int(d, 0, 1 << 48) for d in t["shape"])
            and isinstance(t["stride"], list)
            and len(t["stride"]) == len(t["shape"])
            and all(_is_int(s, 0, 1 << 48) for s in t["stride"])
            and _is_int(t["storage_offset"])
            and isinstance(t["requires_grad"], bool)
            and isinstance(t["parameter"], bool)
        )
        if not ok:
            raise self.fail(f"tensors[{i}] is malformed: {t}")
        record = records.TensorRecord(
            t["storage"],
            t["dtype"],
            tuple(t["shape"]),
            tuple(t["stride"]),
            t["storage_offset"],
            t["requires_grad"],
            t["parameter"],
        )
        if math.prod(record.shape) > _MAX_SIZE:
            raise self.fail(f"tensors[{i}] has more elements than any tensor can: {t['shape']}")
        if math.prod(record.shape):
            last = record.storage_offset + sum(
                (d - 1) * s for d, s in zip(record.shape, record.stride, strict=True)
            )
            needed = (last + 1) * DTYPES[record.dtype].itemsize
            if needed > storages[record.storage].nbytes:
                raise self.fail(
                    f"tensors[{i}] reaches byte {needed} of a "
                    f"{storages[record.storage].nbytes}-byte storage"
                )
        return record

    def extent(
        self,
        i: int,
        e: dict[str, Any],
        files: list[records.DataFile],
        storages: list[records.StorageRecord],
    ) -> records.Extent:
        if not all(_is_int(e[k]) for k in ("storage", "start", "length", "file", "offset")):
            raise self.fail(f"extents[{i}] has a negative, non-integer or overflowing field: {e}")
        if e["storage"] >= len(storages) or e["file"] >= len(files):
            raise self.fail(f"extents[{i}] refers to a storage or file that does not exist: {e}")
        if e["offset"] % ALIGNMENT:
            raise self.fail(f"extents[{i}] offset {e['offset']} is not {ALIGNMENT}-aligned")
        extra = self.extent_v4(i, e) if self.version >= REFERENCES_VERSION else {}
        stored = extra.get("stored") or e["length"]
        if e["offset"] + stored > files[e["file"]].size:
            raise self.fail(
                f"extents[{i}] ends at {e['offset'] + stored}, beyond "
                f"{files[e['file']].name} ({files[e['file']].size} bytes)"
            )
        if e["start"] + e["length"] > storages[e["storage"]].nbytes:
            raise self.fail(
                f"extents[{i}] ends beyond its storage's {storages[e['storage']].nbytes} bytes"
            )
        if not _is_int(e["crc32c"], 0, 0xFFFFFFFF):
            raise self.fail(f"extents[{i}] crc32c {e['crc32c']!r} is not a 32-bit value")
        return records.Extent(**{k: e[k] for k in _EXTENT_V1}, **extra)

    def extent_v4(self, i: int, e: dict[str, Any]) -> dict[str, Any]:
        """The version-4 fields of an extent, checked; raw (``none``) extents get the in-memory
        form (``stored`` and ``stored_crc32c`` 0: the same as ``length`` and ``crc32c``)."""
        codec, stored, stored_crc, digest = (e["codec"], e["stored"], e["stored_crc32c"],
                                             e["blake3"])
        if codec not in CODECS:
            raise self.fail(f"extents[{i}] codec {codec!r} is not one of {list(CODECS)}")
        if not _is_int(stored) or not _is_int(stored_crc, 0, 0xFFFFFFFF):
            raise self.fail(f"extents[{i}] stored / stored_crc32c is not an integer in range")
        if not isinstance(digest, str) or (digest and not BLAKE3_128_HEX.match(digest)):
            raise self.fail(f"extents[{i}] blake3 {digest!r} is not \"\" or 32 hex digits")
        if codec == CODEC_NONE:
            if stored != e["length"] or stored_crc != e["crc32c"]:
                raise self.fail(f"extents[{i}] is stored raw: its stored length and "
                                "stored_crc32c must equal length and crc32c")
            return {"codec": codec, "stored": 0, "stored_crc32c": 0, "blake3": digest}
        if stored < 1 or e["length"] < 1:
            raise self.fail(f"extents[{i}] is encoded but empty")
        return {"codec": codec, "stored": stored, "stored_crc32c": stored_crc, "blake3": digest}

    def coverage(
        self, extents: list[records.Extent], storages: list[records.StorageRecord]
    ) -> None:
        """Each storage must be covered exactly once, with no gap and no overlap."""
        by_storage: dict[int, list[records.Extent]] = {}
        for e in extents:
            by_storage.setdefault(e.storage, []).append(e)
        for index, storage in enumerate(storages):
            covered = 0
            for e in sorted(by_storage.get(index, []), key=lambda e: e.start):
                if e.start != covered:
                    raise self.fail(f"storage {index} has a gap or overlap at byte {covered}")
                covered += e.length
            if covered != storage.nbytes:
                raise self.fail(
                    f"storage {index} is {storage.nbytes} bytes but extents cover {covered}"
                )

    def tree(self, node: Any, n_tensors: int, placeholders: int | None = None) -> int:
        try:
            return _tree.validate(node, n_tensors, placeholders=placeholders,
                                  extra_leaves=self.version >= leaves.VERSION)
        except ValueError as e:
            raise self.fail(str(e)) from None


def data_file_path(
    checkpoint: str, m: Manifest, index: int, roots: dict[str, str] | None = None
) -> str:
    """Where data file ``index`` of ``m`` lives, for the checkpoint directory ``checkpoint``.

    ``roots`` maps recorded external roots to where they are now (``load(data_dirs=...)``).
    Raises :class:`ManifestError` if the file's real path (symlinks resolved) leaves its directory.
    """
    f = m.files[index]
    if f.base:
        return base_file_path(checkpoint, m, index)
    if f.dir == 0:
        base = checkpoint
    else:
        d = m.dirs[f.dir - 1]
        base = os.path.join((roots or {}).get(d.root, d.root), d.name)
    full = os.path.join(base, f.name)
    real_base, real = os.path.realpath(base), os.path.realpath(full)
    if os.path.commonpath([real_base, real]) != real_base:
        raise ManifestError(
            f"data file {full} resolves to {real}, outside its directory "
            f"{real_base}; refusing to read it"
        )
    return full


def base_dir_path(checkpoint: str, m: Manifest, base: int) -> str:
    """The directory of ``m.bases[base - 1]``: a sibling of ``checkpoint``. Raises
    :class:`ManifestError` if it is the checkpoint itself or (symlinks resolved) not a directory
    of the same parent: a reference never leaves the checkpoint's root."""
    ref = m.bases[base - 1]
    parent = os.path.dirname(os.path.abspath(checkpoint))
    if ref.name == os.path.basename(os.path.abspath(checkpoint)):
        raise ManifestError(f"{checkpoint} refers to itself as its base checkpoint {ref.name}")
    full = os.path.join(parent, ref.name)
    real_parent, real = os.path.realpath(parent), os.path.realpath(full)
    if os.path.dirname(real) != real_parent:
        raise ManifestError(
            f"base checkpoint {full} of {checkpoint} resolves to {real}, outside the "
            f"checkpoint's root {real_parent}; refusing to read it")
    return full


def base_file_path(checkpoint: str, m: Manifest, index: int) -> str:
    """Where data file ``index`` (one of a base checkpoint's files) lives; refused like
    :func:`data_file_path` if it leaves the base directory."""
    f = m.files[index]
    base = base_dir_path(checkpoint, m, f.base)
    full = os.path.join(base, f.name)
    real_base, real = os.path.realpath(base), os.path.realpath(full)
    if os.path.commonpath([real_base, real]) != real_base:
        raise ManifestError(
            f"data file {full} resolves to {real}, outside its directory {real_base}; "
            "refusing to read it")
    return full


def storage_keys(tree: Any, tensors: list[records.TensorRecord],
                 prefix: str = "") -> dict[int, str]:
    """Storage index -> the key path of its first tensor (lowest tensor index) in ``tree``:
    what an incremental save compares storages by (``prefix`` names a rank's local part)."""
    keys: dict[int, tuple[int, str]] = {}
    for i, path in _tree.tensor_paths(tree).items():
        s = tensors[i].storage
        if s not in keys or i < keys[s][0]:
            keys[s] = (i, prefix + path)
    return {s: p for s, (_, p) in keys.items()}


def manifest_storage_keys(m: Manifest) -> dict[int, str]:
    """:func:`storage_keys` of every storage of a checkpoint: the main tree's by key path,
    rank-local ones prefixed with their rank (``rank 3: [0]['state']...``)."""
    keys = storage_keys(m.tree, m.tensors)
    for sec in m.sections:
        keys.update(storage_keys(sec.tree, m.tensors, local_prefix(sec.rank)))
    return keys


def local_prefix(rank: int) -> str:
    return f"rank {rank}: "


def sections_tree(m: Manifest, ranks: Any = None) -> Any:
    """The main tree with each rank-local placeholder replaced.

    ``ranks`` None: by ``{"t": "dict", "k": [rank, ...], "v": [subtree, ...]}`` over every
    section (all ranks' parts); an int: by that rank's subtree (ManifestError if it has none).
    """
    by_rank = {
        s.rank: _tree.list_items(s.tree) or [] for s in sorted(m.sections, key=lambda s: s.rank)
    }
    if (
        isinstance(ranks, int)
        and not isinstance(ranks, bool)
        and _tree.has_locals(m.tree)
        and ranks not in by_rank
    ):
        raise ManifestError(
            f"the checkpoint has no rank-local state for rank {ranks} (it holds "
            f"ranks {sorted(by_rank)})"
        )
    if ranks is None:
        return _tree.fill_locals(
            m.tree, lambda j: _tree.mapping(list(by_rank), [v[j] for v in by_rank.values()])
        )
    return _tree.fill_locals(m.tree, lambda j: by_rank[ranks][j])


def full_tree(m: Manifest) -> Any:
    """The tree of everything the checkpoint holds: rank-local parts in place, by rank."""
    return sections_tree(m) if m.sections else m.tree


def storage_descriptions(m: Manifest) -> Callable[[int], str]:
    """``describe(storage)``: the storage in words, by the key paths of its tensors."""
    paths = _tree.tensor_paths(full_tree(m))
    by_storage: dict[int, list[str]] = {}
    for i, t in enumerate(m.tensors):
        by_storage.setdefault(t.storage, []).append(paths.get(i, f"tensor #{i}"))

    def describe(storage: int) -> str:
        names = by_storage.get(storage, [f"storage #{storage}"])
        more = f" (and {len(names) - 1} tensors sharing its storage)" if len(names) > 1 else ""
        return f"tensor {names[0]}{more}"

    return describe
