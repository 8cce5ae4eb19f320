"""The ``torch.save`` container: a zip archive that stock ``torch.load`` reads, laid out so the
engine can write it (and read it) with large aligned I/O. Pure data: bytes in, bytes out.

What ``torch.save`` writes (torch 2.13; checked by tests/test_torch_file.py against torch's own
files) and what we write the same way: every record sits in one folder ``<archive>/``
(``torch.load`` takes the first record's folder and needs every record in it), STORED (never
compressed), each local header's extra field ``"FB" <u16 n> "Z" * n`` padding its data to an
aligned offset, sizes and CRC-32 in a data descriptor after the data (so a header can be written
before its bytes), a zip64 end record always. Records, in order::

    data.pkl             the pickle (protocol 2) of the state, storages as persistent ids
    .format_version      "1": data/N numbered in first-use order
    .storage_alignment   the alignment of data/N (ours: 4096)
    byteorder            "little" / "big"
    data/0 .. data/N-1   raw storage bytes, consecutive, in key order
    .gds_persist/checksums.json   ours: CRC32C of every record (torch.load ignores it)
    version              "3\\n"
    .data/serialization_id

``torch.load`` checks no CRC at all (its zip reader is built without CRC checks), so the
CRC-32 fields of ``data/N`` hold 0, as in files written with torch's own
``set_crc32_options(False)``: the CRC32C of the checksums record is what gds_persist verifies.

Layout for the engine: ``data/N`` start at 4096-aligned offsets; everything between two storages
(a descriptor and the next local header) is *glue*, small byte strings at known offsets; the
tail (from the checksums record's data, 4096-aligned, to the end) is known only once the
storages' CRC32C are, and is written last.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArchiveError
from .checksum import crc32c
from .records import ALIGNMENT, align_up

PICKLE_RECORD = "data.pkl"
CHECKSUM_RECORD = ".gds_persist/checksums.json"
CHECKSUM_FORMAT = "gds_persist.torch"
CHECKSUM_VERSION = 1
ZIP_MAGIC = b"PK\x03\x04"  # torch.load's test for the zip container: the first four bytes
META_ALIGNMENT = 64  # torch's own storage alignment; enough for the small records
FORMAT_VERSION = b"1"
ARCHIVE_VERSION = b"3\n"  # what torch 2.13 writes into "version" (readers take 1..10)

_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_SIG_LOCAL, _SIG_CENTRAL, _SIG_DESCRIPTOR = 0x04034B50, 0x02014B50, 0x08074B50
_SIG_EOCD, _SIG_ZIP64_EOCD, _SIG_ZIP64_LOCATOR = 0x06054B50, 0x06064B50, 0x07064B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_FLAG_DESCRIPTOR, _FLAG_UTF8 = 0x0008, 0x0800
_STORED, _ZIP64_EXTRA = 0, 0x0001
_DOS_DATE = (1 << 5) | 1  # 1980-01-01: a constant keeps the file deterministic
_VERSION_STORED, _VERSION_ZIP64 = 20, 45


# --- one record -----------------------------------------------------------------------------

@dataclass
class Record:
    """Where one zip record lives: its local header at ``header``, its data at ``data``."""

    name: str  # inside the archive folder, e.g. "data/0"
    header: int
    data: int
    size: int
    zip64_sizes: bool
    zip64_offset: bool
    pad: int  # 'Z' bytes of the padding extra field
    crc32: int = 0  # zip CRC-32 (0 for storages: see the module docstring)
    streamed: bool = False  # size unknown when the header is written (the checksums record)

    @property
    def zip64(self) -> bool:
        return self.zip64_sizes or self.zip64_offset

    @property
    def has_descriptor(self) -> bool:
        return bool(self.size) or self.streamed  # torch writes none for empty records

    @property
    def descriptor_size(self) -> int:
        return (24 if self.zip64 else 16) if self.has_descriptor else 0

    @property
    def end(self) -> int:
        return self.data + self.size + self.descriptor_size

    def local_header(self, folder: str) -> bytes:
        name = f"{folder}/{self.name}".encode()
        fields = (struct.pack("<QQ", self.size, self.size) if self.zip64_sizes else b"") + (
            struct.pack("<Q", self.header) if self.zip64_offset else b"")
        extra = struct.pack("<HH", _ZIP64_EXTRA, len(fields)) + fields if self.zip64 else b""
        extra += b"FB" + struct.pack("<H", self.pad) + b"Z" * self.pad
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if self.has_descriptor else 0)
        head = _LOCAL.pack(_SIG_LOCAL, _VERSION_ZIP64 if self.zip64 else _VERSION_STORED, flags,
                           _STORED, 0, _DOS_DATE, 0, 0, 0, len(name), len(extra))
        return head + name + extra

    def descriptor(self) -> bytes:
        if not self.has_descriptor:
            return b""
        layout = "<IIQQ" if self.zip64 else "<IIII"
        return struct.pack(layout, _SIG_DESCRIPTOR, self.crc32, self.size, self.size)

    def central_entry(self, folder: str) -> bytes:
        name = f"{folder}/{self.name}".encode()
        fields, size32, offset32 = b"", self.size, self.header
        if self.zip64_sizes:  # the zip64 extra holds exactly the saturated slots, in order
            fields, size32 = struct.pack("<QQ", self.size, self.size), _U32
        if self.zip64_offset:
            fields, offset32 = fields + struct.pack("<Q", self.header), _U32
        extra = struct.pack("<HH", _ZIP64_EXTRA, len(fields)) + fields if fields else b""
        version = _VERSION_ZIP64 if self.zip64 else _VERSION_STORED
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if self.has_descriptor else 0)
        head = _CENTRAL.pack(_SIG_CENTRAL, version, version, flags, _STORED, 0, _DOS_DATE,
                             self.crc32, size32, size32, len(name), len(extra), 0, 0, 0, 0,
                             offset32)
        return head + name + extra


def place(name: str, header: int, size: int, alignment: int, folder: str) -> Record:
    """A record whose local header starts at ``header``, its data padded to ``alignment``
    (torch's padding rule, so torch.load's own offset arithmetic holds for our files too)."""
    zip64_sizes, zip64_offset = size >= _U32, header >= _U32
    zip64_len = (4 + 16 * zip64_sizes + 8 * zip64_offset) if zip64_sizes or zip64_offset else 0
    start = header + _LOCAL.size + len(f"{folder}/{name}".encode()) + zip64_len + 4
    data = align_up(start, alignment)
    if data - start > _U16:
        raise ArchiveError(f"alignment {alignment} needs more padding than a zip extra field holds")
    return Record(name, header, data, size, zip64_sizes, zip64_offset, data - start)


def end_records(cd_offset: int, cd_size: int, count: int) -> bytes:
    """The zip64 end record and its locator (always, as torch writes them), then the classic one."""
    zip64 = _ZIP64_EOCD.pack(_SIG_ZIP64_EOCD, _ZIP64_EOCD.size - 12, _VERSION_ZIP64,
                             _VERSION_ZIP64, 0, 0, count, count, cd_size, cd_offset)
    locator = _ZIP64_LOCATOR.pack(_SIG_ZIP64_LOCATOR, 0, cd_offset + cd_size, 1)
    eocd = _EOCD.pack(_SIG_EOCD, 0, 0, min(count, _U16), min(count, _U16), min(cd_size, _U32),
                      min(cd_offset, _U32), 0)
    return zip64 + locator + eocd


# --- the archive ----------------------------------------------------------------------------

@dataclass
class ArchiveLayout:
    """Every byte of a torch.save archive of ``storage_sizes`` except the tail's contents.

    ``head``: the small records before the storages (contents known); ``storages``: data/N;
    ``checksums``: the checksums record, whose data starts at ``tail_offset`` (aligned)."""

    folder: str
    head: list[tuple[Record, bytes]]
    storages: list[Record]
    checksums: Record
    alignment: int = ALIGNMENT

    @property
    def tail_offset(self) -> int:
        return self.checksums.data

    def glue(self) -> list[tuple[int, bytes]]:
        """``(offset, bytes)`` of everything before ``tail_offset`` that is not storage data:
        the head records and each local header and descriptor, joined where adjacent."""
        pieces: list[tuple[int, bytes]] = []
        cursor, chunk = 0, bytearray()
        for rec, content in self.head:
            chunk += rec.local_header(self.folder) + content + rec.descriptor()
        for rec in self.storages:
            chunk += rec.local_header(self.folder)
            pieces.append((cursor, bytes(chunk)))
            cursor, chunk = rec.data + rec.size, bytearray(rec.descriptor())
        chunk += self.checksums.local_header(self.folder)
        pieces.append((cursor, bytes(chunk)))
        return [(at, data) for at, data in pieces if data]

    def tail(self, storage_crc32c: Sequence[int], writer: dict[str, Any]) -> bytes:
        """The bytes from ``tail_offset`` to the end: the checksums record (CRC32C of every
        record; ``writer``: who wrote it, for humans), ``version``, the serialization id, the
        central directory and the end records."""
        crcs = {rec.name: crc32c(content) for rec, content in self.head}
        crcs.update({rec.name: c for rec, c in zip(self.storages, storage_crc32c, strict=True)})
        doc = {"format": CHECKSUM_FORMAT, "version": CHECKSUM_VERSION, "algorithm": "crc32c",
               "alignment": self.alignment, "writer": writer,
               "records": {name: f"{c:08x}" for name, c in crcs.items()}}
        content = json.dumps(doc, sort_keys=True).encode()
        self.checksums.size = len(content)
        self.checksums.crc32 = zlib.crc32(content)
        out = bytearray(content + self.checksums.descriptor())
        records = [rec for rec, _ in self.head] + self.storages + [self.checksums]
        cursor = self.checksums.end
        for name, data in (("version", ARCHIVE_VERSION),
                           (".data/serialization_id", _serialization_id(records))):
            rec = place(name, cursor, len(data), META_ALIGNMENT, self.folder)
            rec.crc32 = zlib.crc32(data)
            out += bytes(rec.header - cursor) + rec.local_header(self.folder) + data
            out += rec.descriptor()
            records.append(rec)
            cursor = rec.end
        central = b"".join(r.central_entry(self.folder) for r in records)
        return bytes(out + central + end_records(cursor, len(central), len(records)))


def plan_archive(folder: str, pickle_bytes: bytes, storage_sizes: Sequence[int],
                 alignment: int = ALIGNMENT) -> ArchiveLayout:
    """Lay out the archive of one pickle and its storages (data/N in key order)."""
    if not folder or "/" in folder or "\\" in folder:
        raise ArchiveError(f"invalid archive folder name {folder!r}")
    head = []
    cursor = 0
    for name, content in ((PICKLE_RECORD, pickle_bytes), (".format_version", FORMAT_VERSION),
                          (".storage_alignment", str(alignment).encode()),
                          ("byteorder", sys.byteorder.encode())):
        rec = place(name, cursor, len(content), META_ALIGNMENT, folder)
        rec.crc32 = zlib.crc32(content)  # small: a real CRC-32, for zip tools
        head.append((rec, content))
        cursor = rec.end
    storages = []
    for k, size in enumerate(storage_sizes):  # consecutive, in key order (torch's own order)
        rec = place(f"data/{k}", cursor, size, alignment, folder)
        storages.append(rec)
        cursor = rec.end
    checksums = place(CHECKSUM_RECORD, cursor, 0, alignment, folder)
    checksums.streamed = True
    return ArchiveLayout(folder, head, storages, checksums, alignment)


def archive_folder(file_name: str) -> str:
    """The folder torch.save itself uses for a path: the base name without its last extension
    (``"archive"`` where that is empty or not ASCII)."""
    stem = file_name.rsplit(".", 1)[0] if "." in file_name.lstrip(".") else file_name
    return stem if stem and stem.isascii() and "/" not in stem else "archive"


def _serialization_id(records: Sequence[Record]) -> bytes:
    """40 digits, as torch writes them (a hash of the record names, then of their CRCs; the
    reader only logs it)."""
    names = crc32c("\n".join(r.name for r in records).encode())
    crcs = crc32c(b"".join(struct.pack("<I", r.crc32) for r in records))
    return f"{names:020d}{crcs:020d}".encode()


# --- reading --------------------------------------------------------------------------------

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> the bytes there (short at the end)


@dataclass(frozen=True)
class RecordInfo:
    name: str  # inside the archive folder
    data: int  # file offset of the first byte
    size: int
    method: int  # 0: stored
    crc32: int


@dataclass
class ArchiveIndex:
    """The records of a zip archive, by name (central directory order kept)."""

    folder: str
    records: dict[str, RecordInfo] = field(default_factory=dict)

    def checked(self, name: str) -> RecordInfo:
        rec = self.records.get(name)
        if rec is None:
            raise ArchiveError(f"the archive has no record {self.folder}/{name}")
        if rec.method != _STORED:
            raise ArchiveError(f"record {self.folder}/{name} is compressed (zip method "
                               f"{rec.method}); only stored records can be read in place")
        return rec


def read_index(read_at: ReadAt, file_size: int) -> ArchiveIndex:
    """Parse the end records, the central directory and each local header (the data offset
    is the local header's: torch's padding lives only there)."""
    central = read_central(read_at, file_size)
    index = ArchiveIndex(central.folder)
    for entry in central.entries:
        index.records[entry.rel] = located(read_at, central, entry)
    return index


@dataclass(frozen=True)
class CentralEntry:
    """One record as the zip central directory describes it."""

    rel: str  # its name inside the archive folder
    header: int  # file offset of its local header
    size: int
    csize: int
    method: int
    crc32: int


@dataclass(frozen=True)
class CentralDirectory:
    folder: str
    entries: list[CentralEntry]
    cd_offset: int  # where the central directory starts: every record's data lies before it


def read_central(read_at: ReadAt, file_size: int) -> CentralDirectory:
    """Parse the end records and the central directory (no local header is read)."""
    tail_len = min(file_size, _EOCD.size + _U16 + _ZIP64_LOCATOR.size)
    tail = read_at(file_size - tail_len, tail_len)
    pos = tail.rfind(struct.pack("<I", _SIG_EOCD))
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise ArchiveError("no zip end-of-central-directory record (a truncated file?)")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    locator = pos - _ZIP64_LOCATOR.size
    if locator >= 0 and struct.unpack_from("<I", tail, locator)[0] == _SIG_ZIP64_LOCATOR:
        z64_at = _ZIP64_LOCATOR.unpack_from(tail, locator)[2]
        sig, *_, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(read_at(z64_at, _ZIP64_EOCD.size))
        if sig != _SIG_ZIP64_EOCD:
            raise ArchiveError("a bad zip64 end-of-central-directory record")
    if cd_offset + cd_size > file_size:
        raise ArchiveError("the zip central directory lies beyond the end of the file")
    cd = read_at(cd_offset, cd_size)
    entries = []
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(cd):
            raise ArchiveError("the zip central directory is cut short")
        (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len,
         _, _, _, header) = _CENTRAL.unpack_from(cd, pos)
        if sig != _SIG_CENTRAL:
            raise ArchiveError(f"a bad zip central directory entry at offset {cd_offset + pos}")
        start = pos + _CENTRAL.size
        name = cd[start : start + name_len].decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
        extra = cd[start + name_len : start + name_len + extra_len]
        size, csize, header = _zip64_values(extra, size, csize, header)
        entries.append((name, header, size, csize, method, crc))
        pos = start + name_len + extra_len + comment_len
    if not entries or "/" not in entries[0][0]:
        raise ArchiveError("not a torch.save archive: its first record is not in a folder")
    folder = entries[0][0].split("/", 1)[0]
    for name, *_ in entries:
        if not name.startswith(folder + "/"):
            raise ArchiveError(f"record {name!r} is outside the archive folder {folder!r}")
    return CentralDirectory(folder, [CentralEntry(name[len(folder) + 1:], *rest)
                                     for name, *rest in entries], cd_offset)


def located(read_at: ReadAt, central: CentralDirectory, entry: CentralEntry) -> RecordInfo:
    """``entry`` with its data offset, from its local header."""
    local = read_at(entry.header, _LOCAL.size)
    name = f"{central.folder}/{entry.rel}"
    if len(local) < _LOCAL.size or _LOCAL.unpack(local)[0] != _SIG_LOCAL:
        raise ArchiveError(f"a bad zip local header for {name!r} at offset {entry.header}")
    name_len, extra_len = _LOCAL.unpack(local)[-2:]
    return _record(central, entry, entry.header + _LOCAL.size + name_len + extra_len)


def predicted(central: CentralDirectory, entry: CentralEntry, alignment: int) -> RecordInfo:
    """``entry`` with the data offset our writer gives it (:func:`place`), its local header not
    read: :func:`check_predicted` reads them later, all at once."""
    return _record(central, entry, place(entry.rel, entry.header, entry.size, alignment,
                                         central.folder).data)


Predicted = tuple[CentralEntry, RecordInfo]  # a record placed by the writer's rule, unchecked


def check_predicted(read_at: ReadAt, central: CentralDirectory,
                    records: Sequence[Predicted]) -> None:
    """ArchiveError unless every record's local header puts its data where it was predicted."""
    for entry, rec in records:
        actual = located(read_at, central, entry).data
        if actual != rec.data:
            raise ArchiveError(f"record {central.folder}/{entry.rel}: its local header puts its "
                               f"data at offset {actual}, not at {rec.data} as gds_persist "
                               "writes it (the archive was rewritten by another tool?)")


def _record(central: CentralDirectory, entry: CentralEntry, data: int) -> RecordInfo:
    if data + entry.csize > central.cd_offset:
        raise ArchiveError(f"record {central.folder + '/' + entry.rel!r} overlaps the zip "
                           "central directory")
    return RecordInfo(entry.rel, data, entry.size, entry.method, entry.crc32)


def _zip64_values(extra: bytes, size: int, csize: int, header: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            size = next(values) if size == _U32 else size
            csize = next(values) if csize == _U32 else csize
            header = next(values) if header == _U32 else header
            break
        pos += 4 + length
    return size, csize, header


def alignment_of(content: bytes) -> int | None:
    """The storage alignment our checksums record states (None if absent or not a power of 2
    of at least 64: then nothing is predicted from it)."""
    try:
        value = json.loads(content).get("alignment")
    except (ValueError, AttributeError):
        return None
    ok = isinstance(value, int) and value >= 64 and value & (value - 1) == 0
    return value if ok else None


def parse_checksums(content: bytes) -> dict[str, int]:
    """The CRC32C of every record, from our checksums record; ArchiveError if malformed."""
    try:
        doc = json.loads(content)
        if doc.get("format") != CHECKSUM_FORMAT or doc.get("algorithm") != "crc32c":
            raise ValueError(f"format {doc.get('format')!r}, algorithm {doc.get('algorithm')!r}")
        return {name: int(value, 16) for name, value in doc["records"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArchiveError(f"the checksums record {CHECKSUM_RECORD} is malformed ({e})") from None


def writer_of(content: bytes) -> dict[str, Any]:
    """The ``writer`` entry of our checksums record ({} if absent)."""
    try:
        return dict(json.loads(content).get("writer") or {})
    except (ValueError, AttributeError):
        return {}
