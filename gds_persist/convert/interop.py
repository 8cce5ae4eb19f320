"""Move checkpoints between gds_persist and the formats trainers already use.

* :func:`export_checkpoint` writes a gds_persist checkpoint (also one written through DCP with
  :class:`gds_persist.dcp.GdsPersistWriter`) as a ``torch.save`` file or a ``.safetensors`` file.
* :func:`import_checkpoint` turns a ``torch.save`` file or a ``.safetensors`` file into a
  gds_persist checkpoint.

Every CRC32C is verified while exporting, output files appear atomically (temporary sibling,
fsync, rename), and nothing is unpickled except by ``torch.load(weights_only=True)``, which
builds only tensors and plain containers and never runs code from the file.

Memory
------
* safetensors export streams: the header is computed from the manifest alone, then the data is
  read block by block through the staging ring by the reader ``load`` uses (CRC32C checked per
  extent) and written at its final offset. Memory stays at the staging ring (``staging_bytes``),
  except for a storage that holds a non-contiguous view: that storage is read whole (bounded by
  that storage, not the checkpoint) so the view can be made contiguous.
* torch export cannot stream: ``torch.save`` pickles a complete object graph, so the whole state
  dict is loaded into host memory first (as ``torch.save`` itself requires).
* imports map the source file (``mmap``): a zip-format ``torch.save`` file is opened with
  ``torch.load(mmap=True)`` and a safetensors file is mapped directly, so tensor bytes are paged
  in from the file as the writer copies them instead of being read into anonymous memory first.
  Legacy (non-zip) ``torch.save`` files cannot be mapped and are loaded whole.

What safetensors cannot hold, and what happens
----------------------------------------------
safetensors holds a flat mapping ``name -> contiguous tensor`` plus string metadata.

* nested containers (dicts, lists, tuples): keys are joined with ``sep`` (default ``"."``, so
  ``{"model": {"fc.weight": t}}`` becomes ``"model.fc.weight"`` as Hugging Face tools expect;
  list/tuple positions become their index). Two paths that join to the same name are refused
  (``ValueError``; choose another ``sep``). The exact structure is kept in the metadata entry
  ``"gds_persist"`` so :func:`import_checkpoint` restores it.
* non-tensor leaves (ints, floats incl. inf/nan, bools, strings, None): not tensors, so
  ``safetensors.torch.load_file`` does not return them; they are kept in that metadata entry
  and restored by :func:`import_checkpoint`.
* tensors sharing a storage (tied weights): safetensors cannot alias, so each tensor is written
  with its own copy of its bytes. Tensors that are identical views of one storage (the common
  case: tied embedding / LM-head weights) are recorded and come back as one shared tensor on
  import; partially overlapping views come back as independent copies.
* non-contiguous views: written as their contiguous copy (values equal, strides not kept).
* ``nn.Parameter`` / ``requires_grad``: kept in the metadata, restored on import.
* dtypes safetensors has no code for (e.g. complex128, float8 variants other than e4m3fn/e5m2
  and their fnuz forms, bit/quantized types) and a state dict that is a bare tensor: refused with
  a ``TypeError`` naming the key; use ``to="torch"``.
"""

from __future__ import annotations

import errno
import io
import json
import math
import mmap
import os
import pickle
import struct
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .. import settings
from ..backends.posix import pwrite_all
from ..errors import CheckpointError
from ..format import DTYPES, Extent, Manifest, TensorRecord, full_tree, leaves
from ..format.tree import decode, path_str, tensor_key_paths, validate, walk
from ..loading.destinations import contiguous, tensor_leaves
from ..loading.extents import read_extents
from ..loading.load import load, read_manifest
from ..progress import ByteCounter, ProgressCallback
from ..results import ExportInfo, SaveInfo
from ..saving.save import save
from ..state.flatten import flatten, rebuild_tensor
from ..transfer.commit import fsync_path
from ..transfer.opened import OpenCheckpoint, opened

FORMATS = ("torch", "safetensors")
META_KEY = "gds_persist"
_META_VERSION = 1
_MAX_HEADER = 100 << 20  # what safetensors itself accepts

# safetensors dtype codes this exporter writes. The uint16/32/64, complex64 and fnuz float8 codes
# are known to recent safetensors releases only (tested with 0.8).
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


# --------------------------------------------------------------------------- helpers


def _infer_format(out: str, to: str | None) -> str:
    if to is None:
        to = "safetensors" if out.endswith(".safetensors") else "torch"
    if to not in FORMATS:
        raise ValueError(f"unknown export format {to!r}; valid: {', '.join(FORMATS)}")
    return to


class _AtomicFile:
    """Write ``path`` through a temporary sibling that is fsynced and renamed into place."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        base = os.path.basename(self.path)
        self.tmp = os.path.join(os.path.dirname(self.path), f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.path)
        fsync_path(os.path.dirname(self.path))

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class _CountingFile(io.RawIOBase):
    """A write-only file object over a descriptor that reports bytes to a counter."""

    def __init__(self, fd: int, counter: ByteCounter):
        self.fd = fd
        self.counter = counter

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = os.write(self.fd, b)
        self.counter.add(n)
        return n


def _is_dcp(m: Manifest) -> bool:
    from ..dcp.writer import WRITER_TAG  # imported here: it pulls in torch.distributed.checkpoint

    return m.writer.get("writer") == WRITER_TAG


def _consolidate_dcp(path: str, backend: str | None) -> Any:
    """A DCP checkpoint as one full (unsharded) state dict on the CPU, via DCP's own planner."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..dcp import GdsPersistReader

    sd: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(
            sd,
            storage_reader=GdsPersistReader(path, backend=backend),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return sd


# --------------------------------------------------------------------------- export


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str | None = None,
    sep: str = ".",
    backend: str | None = None,
    progress: ProgressCallback | None = None,
) -> ExportInfo:
    """Write the checkpoint at ``path`` to the file ``out`` as ``to="torch"`` (a ``torch.save``
    file that ``torch.load(out, weights_only=True)`` reads) or ``to="safetensors"`` (read by
    ``safetensors.torch.load_file``); ``None`` infers it from the suffix of ``out``.

    A checkpoint written through DCP (:class:`gds_persist.dcp.GdsPersistWriter`) is first
    consolidated into one full state dict (DCP's own planner; in memory). Every CRC32C is
    verified; a mismatch raises :class:`ChecksumError` and leaves no output file. See the module
    docstring for memory use and what safetensors cannot hold.
    """
    path, out = os.fspath(path), os.fspath(out)
    to = _infer_format(out, to)
    m = read_manifest(path)
    if _is_dcp(m):
        counter = ByteCounter(progress, 2 * m.total_bytes)
        state = _consolidate_dcp(path, backend)
        counter.add(m.total_bytes)
        notes = ["DCP checkpoint consolidated into one full state dict (in memory)"]
        if to == "torch":
            return _export_torch(state, out, counter, notes)
        return _export_safetensors_from_memory(state, out, sep, counter, notes)
    payload = sum(s.nbytes for s in m.storages)
    if to == "torch":
        counter = ByteCounter(progress, m.total_bytes + payload)
        last = [0]

        def on_read(done: int, total: int) -> None:
            counter.add(done - last[0])
            last[0] = done

        state = load(
            path,
            map_location="cpu",
            backend=backend,
            progress=on_read if progress is not None else None,
        )
        notes = ["torch.save cannot stream: the state dict was loaded whole"]
        unsafe = sorted({x for _, n in walk(full_tree(m)) if (x := leaves.needs_safe_globals(n))})
        if unsafe:  # numpy arrays, paths, namespaces: objects to torch.save's pickle
            notes.append(f"it holds {', '.join(unsafe)} leaves: torch.load(OUT, weights_only=True) "
                         "needs their classes allowed (torch.serialization.add_safe_globals)")
        return _export_torch(state, out, counter, notes)
    return opened(path, lambda ck: _SafetensorsExport(ck, out, sep, backend, progress).run())


def _export_torch(state: Any, out: str, counter: ByteCounter, notes: list[str]) -> ExportInfo:
    f = _AtomicFile(out)
    try:
        with _CountingFile(f.fd, counter) as raw, io.BufferedWriter(raw, 16 << 20) as buffered:
            torch.save(state, buffered)
        f.commit()
    except BaseException:
        f.abort()
        raise
    counter.finish()
    n = sum(1 for _ in tensor_leaves(state))
    return ExportInfo(out, "torch", n, os.path.getsize(out), notes)


@dataclass
class _StEntry:
    index: int  # tensor index in the manifest / flattened state
    name: str
    record: TensorRecord
    nbytes: int
    begin: int = 0  # data offset in the safetensors buffer


def _plan_safetensors(
    tree: Any, tensors: list[TensorRecord], sep: str
) -> tuple[list[_StEntry], dict[str, str]]:
    """Names, order and offsets of the tensors, and the metadata that restores the rest."""
    paths = tensor_key_paths(tree)
    entries: list[_StEntry] = []
    seen: dict[str, tuple[Any, ...]] = {}
    for i, rec in enumerate(tensors):
        p = paths[i]
        if not p:
            raise TypeError(
                "cannot export a bare tensor to safetensors: wrap it in a dict "
                "({'weight': t}) or use to='torch'"
            )
        name = sep.join(str(k) for k in p)
        if name in seen:
            raise ValueError(
                f"keys {path_str(seen[name])} and {path_str(p)} both become {name!r} when joined "
                f"with sep={sep!r}; choose another separator (e.g. sep='/')"
            )
        seen[name] = p
        dtype = DTYPES[rec.dtype]
        if dtype not in ST_DTYPES:
            raise TypeError(
                f"cannot export {path_str(p)} to safetensors: it has no code for dtype {dtype}; "
                "use to='torch' (torch.save holds every dtype)"
            )
        entries.append(_StEntry(i, name, rec, math.prod(rec.shape) * dtype.itemsize))
    # data in storage order, so a streaming export reads each storage once, front to back
    entries.sort(key=lambda e: (e.record.storage, e.record.storage_offset, e.index))
    pos = 0
    for e in entries:
        e.begin = pos
        pos += e.nbytes
    tied: dict[tuple[Any, ...], list[str]] = {}
    for e in entries:
        r = e.record
        if e.nbytes:
            tied.setdefault((r.storage, r.storage_offset, r.shape, r.stride, r.dtype), []).append(
                e.name
            )
    by_index = sorted(entries, key=lambda e: e.index)
    meta = {
        "version": _META_VERSION,
        "sep": sep,
        "tree": tree,
        "names": [e.name for e in by_index],
        "parameter": [e.record.parameter for e in by_index],
        "requires_grad": [e.record.requires_grad for e in by_index],
        "tied": [names for names in tied.values() if len(names) > 1],
    }
    return entries, {"format": "pt", META_KEY: json.dumps(meta, separators=(",", ":"))}


def _st_header(entries: list[_StEntry], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        header[e.name] = {
            "dtype": ST_DTYPES[DTYPES[e.record.dtype]],
            "shape": list(e.record.shape),
            "data_offsets": [e.begin, e.begin + e.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned
    if len(raw) > _MAX_HEADER:
        raise ValueError(
            f"the safetensors header would be {len(raw)} bytes, above the "
            f"{_MAX_HEADER}-byte limit of the format"
        )
    return struct.pack("<Q", len(raw)) + raw


class _SafetensorsExport:
    def __init__(
        self,
        ck: OpenCheckpoint,
        out: str,
        sep: str,
        backend: str | None,
        progress: ProgressCallback | None,
    ):
        m = ck.manifest
        self.ck, self.path, self.m, self.out, self.sep = ck, ck.path, m, out, sep
        tree = full_tree(m)  # rank-local parts: {rank: part}
        self.entries, self.metadata = _plan_safetensors(tree, m.tensors, sep)
        self.header = _st_header(self.entries, self.metadata)
        self.cfg = settings.current(backend=backend)
        self.counter = ByteCounter(progress, sum(e.nbytes for e in self.entries))
        self.paths = tensor_key_paths(tree)
        # streamed storages: (storage bytes lo, hi, offset in the output) of each tensor
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}
        self.fd = -1
        self.data_start = 0

    def describe(self, storage: int) -> str:
        names = [path_str(self.paths[e.index]) for e in self.entries if e.record.storage == storage]
        return "tensor " + (
            ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") or f"storage #{storage}"
        )

    def run(self) -> ExportInfo:
        self.ck.open_files(range(len(self.m.files)))  # all held before a byte is read or written
        out = _AtomicFile(self.out)
        self.fd = out.fd
        self.data_start = len(self.header)
        notes: list[str] = []
        try:
            try:  # reserve the space up front: a full disk fails before any data moves
                os.posix_fallocate(
                    self.fd, 0, self.data_start + sum(e.nbytes for e in self.entries)
                )
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            pwrite_all(self.fd, self.header, 0)
            by_storage: dict[int, list[_StEntry]] = {}
            for e in self.entries:
                by_storage.setdefault(e.record.storage, []).append(e)
            copied = []
            for storage, entries in by_storage.items():
                if all(contiguous(e.record) for e in entries):
                    ranges = self.ranges[storage] = []
                    for e in entries:
                        lo = e.record.storage_offset * DTYPES[e.record.dtype].itemsize
                        ranges.append((lo, lo + e.nbytes, self.data_start + e.begin))
                else:
                    notes.append(
                        f"{self.describe(storage)}: non-contiguous view(s) "
                        "written as contiguous copies"
                    )
                    copied.append((storage, entries))
            streamed = [e for e in self.m.extents if e.storage in self.ranges]
            read_extents(self.ck, streamed, None, self.cfg, describe=self.describe,
                         on_bytes=self._stream_piece)
            for storage, entries in copied:
                self._copy_storage(storage, entries)
            out.commit()
        except BaseException:
            out.abort()
            raise
        self.counter.finish()
        if self.metadata and json.loads(self.metadata[META_KEY])["tied"]:
            notes.append("tied tensors written as separate copies (safetensors cannot alias)")
        return ExportInfo(
            self.out, "safetensors", len(self.entries), os.path.getsize(self.out), notes
        )

    def _stream_piece(self, e: Extent, start: int, piece: memoryview) -> None:
        """Bytes ``[start, start + len(piece))`` of storage ``e.storage``, read and about to be
        checksummed: write them wherever the safetensors file holds them."""
        stop = start + piece.nbytes
        for lo, hi, out_off in self.ranges[e.storage]:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                pwrite_all(self.fd, piece[a - start : b - start], out_off + a - lo)
                self.counter.add(b - a)

    def _copy_storage(self, storage: int, entries: list[_StEntry]) -> None:
        """Read one storage whole (bounded by that storage), then write its tensors as
        contiguous copies."""
        data = torch.empty(self.m.storages[storage].nbytes, dtype=torch.uint8)
        dests: list[torch.Tensor | None] = [None] * len(self.m.storages)
        dests[storage] = data
        extents = [e for e in self.m.extents if e.storage == storage]
        read_extents(self.ck, extents, dests, self.cfg, describe=self.describe)
        untyped = data.untyped_storage()
        for e in entries:
            t = rebuild_tensor(e.record, untyped).detach().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if e.nbytes else b""
            pwrite_all(self.fd, raw, self.data_start + e.begin)
            self.counter.add(e.nbytes)


def _export_safetensors_from_memory(
    state: Any, out: str, sep: str, counter: ByteCounter, notes: list[str]
) -> ExportInfo:
    flat = flatten(state)
    entries, metadata = _plan_safetensors(flat.tree, flat.tensors, sep)
    header = _st_header(entries, metadata)
    f = _AtomicFile(out)
    try:
        pwrite_all(f.fd, header, 0)
        for e in entries:
            t = rebuild_tensor(e.record, flat.storage_objects[e.record.storage]).detach()
            if e.nbytes:
                pwrite_all(
                    f.fd,
                    t.contiguous().reshape(-1).view(torch.uint8).numpy(),
                    len(header) + e.begin,
                )
            counter.add(e.nbytes)
        f.commit()
    except BaseException:
        f.abort()
        raise
    counter.finish()
    return ExportInfo(out, "safetensors", len(entries), os.path.getsize(out), notes)


# --------------------------------------------------------------------------- import


def detect_format(file: str) -> str:
    """``"torch"`` or ``"safetensors"``, from the first bytes of ``file``."""
    with open(file, "rb") as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # zip (torch.save) or a legacy pickle
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n <= _MAX_HEADER and 8 + n <= size:
            return "safetensors"
    raise ValueError(
        f"{file} is neither a torch.save file nor a safetensors file "
        "(pass format= to say which it is)"
    )


def import_checkpoint(
    file: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    format: str = "auto",
    backend: str | None = None,  # noqa: A002
    progress: ProgressCallback | None = None,
    **save_options: Any,
) -> SaveInfo:
    """Save the contents of a ``torch.save`` file or a safetensors file as a gds_persist
    checkpoint at ``path`` (atomically, like :func:`gds_persist.save`).

    ``format``: ``"auto"`` (from the file's first bytes), ``"torch"`` or ``"safetensors"``.
    torch files are read with ``torch.load(weights_only=True)`` only: a file that needs any
    other class is refused with a clear error, never unpickled. A safetensors file written by
    :func:`export_checkpoint` gets its nesting, non-tensor leaves, parameters and tied tensors
    back; any other gives a flat ``{name: tensor}`` dict. ``save_options`` go to
    :func:`gds_persist.save` (``block_bytes``, ``staging_bytes``, ``io_threads``).
    """
    file, path = os.fspath(file), os.fspath(path)
    kind = detect_format(file) if format == "auto" else format
    if kind not in FORMATS:
        raise ValueError(f"unknown import format {format!r}; valid: auto, {', '.join(FORMATS)}")
    if kind == "torch":
        state = _load_torch_file(file)
    else:
        state = _map_safetensors(file)
    return save(state, path, backend=backend, progress=progress, **save_options)


def _load_torch_file(file: str) -> Any:
    with open(file, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{file} holds objects that torch.load(weights_only=True) refuses to build "
            f"({first[0] if first else 'unsupported global'}). gds_persist never unpickles "
            "arbitrary code: in an environment you trust, load it and save its tensors and "
            "plain values (e.g. model.state_dict()) with torch.save, then import that file"
        ) from e


def _map_safetensors(file: str) -> Any:
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    if mm is None or size < 8:
        raise CheckpointError(f"{file} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", mm[:8])
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(
            f"{file}: safetensors header length {n} is impossible for a {size}-byte file"
        )
    try:
        header = json.loads(mm[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    buffer_len = size - 8 - n
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        try:
            dtype = ST_CODES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{file}: tensor {name!r} has an unsupported dtype or malformed entry {info!r}"
            ) from None
        nbytes = math.prod(shape) * dtype.itemsize
        if (
            any(d < 0 for d in shape)
            or not 0 <= begin <= end <= buffer_len
            or end - begin != nbytes
        ):
            raise CheckpointError(
                f"{file}: tensor {name!r} has data_offsets {[begin, end]} that do "
                f"not fit its shape {shape} and {dtype} or the file"
            )
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only; we never write to it
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=8 + n + begin)
        tensors[name] = raw.view(dtype).reshape(shape)
    ours = meta.get(META_KEY) if isinstance(meta, dict) else None
    if ours is None:
        return tensors
    return _restore(file, tensors, ours)


def _restore(file: str, tensors: dict[str, torch.Tensor], raw_meta: str) -> Any:
    """Rebuild the exported state dict from the metadata :func:`export_checkpoint` wrote."""
    try:
        meta = json.loads(raw_meta)
        names = meta["names"]
        tree = meta["tree"]
        params, grads, tied = meta["parameter"], meta["requires_grad"], meta["tied"]
        assert meta["version"] == _META_VERSION and len(names) == len(params) == len(grads)
        validate(tree, len(names))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{file}: its gds_persist metadata is malformed ({e})") from None
    if set(names) != set(tensors):
        raise CheckpointError(
            f"{file}: its gds_persist metadata names other tensors than the file holds"
        )
    canonical = {}
    for group in tied:
        for other in group[1:]:
            canonical[other] = group[0]
    out = []
    for name, is_param, needs_grad in zip(names, params, grads, strict=False):
        t = tensors[canonical.get(name, name)]
        if is_param:
            t = torch.nn.Parameter(t, requires_grad=needs_grad)
        elif needs_grad:
            t = t.requires_grad_(True)
        out.append(t)
    # identical tied views must be the very same object, so they share one storage again
    first: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        key = canonical.get(name, name)
        if key in first:
            out[i] = first[key]
        else:
            first[key] = out[i]
    return decode(tree, out)
