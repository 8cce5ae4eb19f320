"""Reading a checkpoint that other processes may replace or delete meanwhile: hold it open first.

Every reader (load, verify, export, the DCP reader, the CLI) opens the checkpoint directory,
reads ``manifest.json`` through that descriptor, and opens every data file it is going to read
before it reads any byte of them (:class:`OpenCheckpoint`). From then on a save that replaces
the path, a Checkpointer removing the step, or a data-parallel save removing the old data
directories cannot take the files away: an unlinked file stays readable through a descriptor.
Backends open :meth:`OpenCheckpoint.source` - ``/proc/self/fd/N``, which reopens the very file
held (with O_DIRECT, and for kvikio's cuFile too), where the real path may name another
checkpoint's file by now.

An incremental checkpoint (format version 4) also reads files of its bases, sibling
checkpoints named in its manifest: each base directory is opened and its ``manifest.json``
checked against the SHA-256 recorded for it before any of its files is opened and held the same
way. A base that is missing (deleted or moved by hand) or replaced since is
:class:`ReferencedCheckpointError`, never bytes of another checkpoint.

The one window is between opening the directory and opening the last file: if a file is missing
then, :meth:`OpenCheckpoint.replaced` tells a replaced or removed checkpoint (the path now names
another directory, or none) from a damaged one. Replaced: :class:`CheckpointReplacedError`,
which :func:`open_checkpoint` and :func:`opened` answer by opening the path again (bounded, with
a short pause); damaged: the usual :class:`TruncatedError` / :class:`NotCommittedError`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import pickle
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..errors import (
    ArchiveError,
    CheckpointPermissionError,
    CheckpointReplacedError,
    ManifestError,
    NotACheckpointDirectoryError,
    NotCommittedError,
    ReferencedCheckpointError,
    SafetensorsError,
    TruncatedError,
)
from ..format import (
    MANIFEST_NAME,
    Manifest,
    base_dir_path,
    data_file_path,
    foreign,
    parse_manifest,
    safetensors,
    torch_archive,
    torch_pickle,
)
from ..format.checksum import crc32c as _crc32c
from ..format.safetensors import looks_like_safetensors, parse_header
from .commit import commit_lock_path, is_temporary, refuse_url

T = TypeVar("T")
OPEN_ATTEMPTS = 8  # openings of one path in a row that may each find it replaced
_PROC_FD = "/proc/self/fd"
_HAS_PROC_FD = os.path.isdir(_PROC_FD)


def root_map(m: Manifest, data_dirs: Any) -> dict[str, str]:
    """``load(data_dirs=...)``: a dict {recorded root: new root}, or a list of new roots in the
    order of the manifest's data directories."""
    if data_dirs is None:
        return {}
    if isinstance(data_dirs, dict):
        return {os.path.normpath(k): os.path.abspath(v) for k, v in data_dirs.items()}
    data_dirs = list(data_dirs)
    recorded = list(dict.fromkeys(d.root for d in m.dirs))
    if len(data_dirs) != len(recorded):
        raise ValueError(f"data_dirs has {len(data_dirs)} entries but the checkpoint records "
                         f"{len(recorded)} data directories ({recorded}); pass a list of that "
                         "length or a dict {recorded: new}")
    return {old: os.path.abspath(os.fspath(new))
            for old, new in zip(recorded, data_dirs, strict=True)}


def _close_all(fds: dict[Any, int]) -> None:
    while fds:
        _, fd = fds.popitem()
        os.close(fd)


class OpenCheckpoint:
    """A committed checkpoint held open: its directory, its validated ``manifest`` and the data
    files opened so far (:meth:`open_files`). Close it (or use it as a context manager); one
    dropped unclosed closes its descriptors when collected. ``verifiable``: the manifest records
    the CRC32C of every extent (not so for a stock safetensors or torch.save file)."""

    verifiable = True

    def __init__(self, path: str, dir_fd: int, raw: bytes, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self.digest = hashlib.sha256(raw).hexdigest()  # which checkpoint (for agreeing ranks)
        self.roots: dict[str, str] = {}  # moved data directories (set_data_dirs)
        self._fds: dict[Any, int] = {"dir": dir_fd}  # "dir", then data file index -> fd
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    def start_layout_check(self) -> None:
        """Start what :meth:`check_layout` waits for (a read starts it: see :class:`OpenFile`);
        a directory's layout is checked when it is opened."""

    def check_layout(self) -> None:
        """Raise what the check :meth:`start_layout_check` started found."""

    def set_data_dirs(self, data_dirs: Any) -> None:
        """Where moved data directories are now (``load(data_dirs=...)``, see :func:`root_map`);
        before any file is opened."""
        self.roots = root_map(self.manifest, data_dirs)

    def replaced(self) -> str:
        """``"removed"`` or ``"replaced"`` if ``path`` no longer names the held directory,
        else ``""``."""
        try:
            now = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return "removed"
        held = os.fstat(self._fds["dir"])
        return "" if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) else "replaced"

    def file_path(self, index: int) -> str:
        """Where data file ``index`` lives (for messages and backend choice)."""
        return data_file_path(self.path, self.manifest, index, self.roots)

    def fd(self, index: int) -> int:
        """The held descriptor of data file ``index`` (opened by :meth:`open_files`)."""
        return self._fds[index]

    def source(self, index: int) -> str:
        """What a backend opens to read data file ``index``: the held file itself."""
        fd = self._fds[index]
        return f"{_PROC_FD}/{fd}" if _HAS_PROC_FD else self.file_path(index)

    def open_files(self, indices: Iterable[int]) -> None:
        """Open (and check the size of) data files ``indices`` not opened yet.

        Raises :class:`CheckpointReplacedError` if one is gone because the checkpoint was
        replaced or removed since its directory was opened, :class:`TruncatedError` if one is
        missing or shorter than the manifest says.
        """
        for index in sorted(set(indices) - self._fds.keys()):
            f = self.manifest.files[index]
            full = self.file_path(index)
            try:
                if f.base:
                    fd = os.open(f.name, os.O_RDONLY | os.O_CLOEXEC,
                                 dir_fd=self._base_dir(f.base))
                elif f.dir == 0:
                    fd = os.open(f.name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._fds["dir"])
                else:
                    fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                why = self.replaced()
                if why:
                    raise CheckpointReplacedError(replaced_message(self.path, why)) from None
                if f.base:
                    raise ReferencedCheckpointError(
                        f"data file {full} of {self.manifest.bases[f.base - 1].name}, the base "
                        f"checkpoint {self.path} refers to, is missing: the base is damaged; "
                        "restore it, or load an earlier standalone checkpoint") from None
                raise TruncatedError(
                    f"data file {full} is missing; the checkpoint is incomplete") from None
            self._fds[index] = fd
            actual = os.fstat(fd).st_size
            if actual < f.size:
                raise TruncatedError(
                    f"data file {full} is {actual} bytes but the manifest records {f.size}: it "
                    "was truncated; restore it or use an earlier checkpoint"
                )


    def _base_dir(self, base: int) -> int:
        """The held directory of ``manifest.bases[base - 1]``, opened and identified (its
        manifest's SHA-256) on first use."""
        key = ("base", base)
        if key in self._fds:
            return self._fds[key]
        ref = self.manifest.bases[base - 1]
        full = base_dir_path(self.path, self.manifest, base)  # ManifestError outside the root
        referred = sum(e.length for e in self.manifest.extents
                       if self.manifest.files[e.file].base == base)
        what = (f"{self.path} refers to {referred} bytes held by the sibling checkpoint "
                f"{ref.name}")
        fix = ("restore that checkpoint there, or load an earlier standalone checkpoint "
               "('gds-persist materialize' makes a standalone copy while the base exists)")
        try:
            fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            why = self.replaced()
            if why:
                raise CheckpointReplacedError(replaced_message(self.path, why)) from None
            raise ReferencedCheckpointError(
                f"{what}, which is missing ({full} was deleted or moved); {fix}") from None
        self._fds[key] = fd
        try:
            manifest_fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            raise ReferencedCheckpointError(
                f"{what}, but {full} holds no committed checkpoint (no manifest.json); "
                f"{fix}") from None
        digest = hashlib.sha256(_read_and_close(manifest_fd)).hexdigest()
        if digest != ref.manifest_sha256:
            why = self.replaced()
            if why:
                raise CheckpointReplacedError(replaced_message(self.path, why))
            raise ReferencedCheckpointError(
                f"{what}, but {full} was replaced since: its manifest.json has SHA-256 "
                f"{digest[:16]}..., the reference recorded {ref.manifest_sha256[:16]}...; the "
                f"referenced bytes are gone; {fix}")
        return fd


def _pread_at(fd: int, offset: int, n: int) -> bytes:
    return os.pread(fd, n, offset)


def open_model_directory(path: str, dir_fd: int) -> OpenCheckpoint | None:
    """A Hugging Face model directory (``model.safetensors``, or the shards its index names)
    held open and described as a manifest (:func:`gds_persist.format.foreign.hf_manifest`);
    None if ``path`` holds neither. Its files are opened (by name, in the held directory) as
    any checkpoint's; ``verifiable``: gds_persist recorded every tensor's CRC32C."""
    try:
        names = [safetensors.SINGLE_NAME]
        try:
            index_fd = os.open(safetensors.INDEX_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
            names = safetensors.index_files(_read_and_close(index_fd))
        except FileNotFoundError:
            pass
        shards, identity = [], b""
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                if name == safetensors.SINGLE_NAME:
                    return None
                raise TruncatedError(f"{os.path.join(path, name)}, named by "
                                     f"{safetensors.INDEX_NAME}, is missing; the model is "
                                     "incomplete") from None
            try:
                size = os.fstat(fd).st_size
                header = parse_header(functools.partial(_pread_at, fd), size)
                identity += os.pread(fd, header.data_start, 0)
            finally:
                os.close(fd)
            shards.append((name, size, header))
        manifest = foreign.hf_manifest(shards)
    except SafetensorsError as e:
        raise ManifestError(f"{path}: not a valid safetensors model directory: {e}") from None
    ck = OpenCheckpoint(path, dir_fd, identity, manifest)
    ck.verifiable = bool(manifest.writer["checksums"])
    return ck


class OpenFile(OpenCheckpoint):
    """A checkpoint that is one file - a ``torch.save`` archive or a safetensors file - held
    open: the file is data file 0 and ``manifest`` describes it (:mod:`gds_persist.format.foreign`).
    ``pickle``: a torch archive's ``data.pkl`` (None for safetensors); ``verifiable``: whether
    the file records the CRC32C of its storages (gds_persist wrote it)."""

    def __init__(self, path: str, fd: int, identity: bytes, manifest: Manifest,
                 pickle: bytes | None, zip_crc32: dict[int, int] | None = None,
                 headers: _HeaderCheck | None = None):
        super().__init__(path, fd, identity, manifest)
        self._fds[0] = os.dup(fd)
        self.pickle = pickle
        self.verifiable = bool(manifest.writer.get("checksums"))
        # a stock torch.save file: the zip CRC-32 of each storage where torch recorded one
        self.zip_crc32 = zip_crc32 or {}
        self._headers = headers

    def start_layout_check(self) -> None:
        """Read the storages' local headers not read at the open on a thread, while the data is
        read (:class:`_HeaderCheck`)."""
        if self._headers is not None:
            self._headers.start(self.fd(0))

    def check_layout(self) -> None:
        """Wait for that thread: ManifestError if a local header puts its data elsewhere than
        where it was read from."""
        if self._headers is not None:
            self._headers.result(self.path, self.fd(0))

    def file_path(self, index: int) -> str:
        return self.path

    def open_files(self, indices: Iterable[int]) -> None:
        """The one data file is the file itself, opened (and its size known) already."""


def open_file(path: str) -> OpenFile:
    """Open a single-file checkpoint and describe it (NotACheckpointDirectoryError for a file
    that is neither a torch.save archive nor a safetensors file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(fd, n, offset)

        head = read_at(0, 16)
        if head[:4] == torch_archive.ZIP_MAGIC:
            manifest, identity, data, zip_crcs, headers = _torch_file(path, read_at, size)
            return OpenFile(path, fd, identity, manifest, data, zip_crcs, headers)
        if looks_like_safetensors(head, size):
            try:
                header = parse_header(read_at, size)
            except SafetensorsError as e:
                raise ManifestError(f"{path}: not a valid safetensors file: {e}") from None
            manifest = foreign.safetensors_manifest(os.path.basename(path), size, header)
            return OpenFile(path, fd, read_at(0, header.data_start), manifest, None)
        pointed = _pointer_target(read_at(0, 64)) if size <= 64 else None
        if pointed is not None:
            root = os.path.dirname(path) or "."
            raise NotACheckpointDirectoryError(
                errno.ENOTDIR, f"{path} is a Checkpointer's pointer to its newest step "
                f"({pointed}), not a checkpoint: load that step, "
                f"{os.path.join(root, pointed)}, or the root's newest committed step with "
                f"gds_persist.Checkpointer({root!r}).load()")
        raise NotACheckpointDirectoryError(
            errno.ENOTDIR, f"{path} is a file but neither a torch.save archive nor a "
            "safetensors file, so not a checkpoint gds_persist reads (a legacy torch.save "
            "file, from torch < 1.6 or _use_new_zipfile_serialization=False: load it with "
            "torch.load(weights_only=True) and save it again)")
    except BaseException:
        os.close(fd)
        raise


def _torch_file(path: str, read_at: Callable[[int, int], bytes], size: int
                ) -> tuple[Manifest, bytes, bytes, dict[int, int], _HeaderCheck | None]:
    """The manifest of a torch.save archive, what identifies it, its data.pkl, the zip CRC-32
    of each storage that records one, and the check of its storages' local headers still
    running (None: every local header was read)."""
    try:
        central = torch_archive.read_central(read_at, size)
        index = torch_archive.ArchiveIndex(central.folder)
        for entry in central.entries:
            if not entry.rel.startswith("data/"):
                index.records[entry.rel] = torch_archive.located(read_at, central, entry)
        rec = index.checked(torch_archive.PICKLE_RECORD)
        data = read_at(rec.data, rec.size)
        stored = (index.checked(torch_archive.CHECKSUM_RECORD)
                  if torch_archive.CHECKSUM_RECORD in index.records else None)
        raw = read_at(stored.data, stored.size) if stored is not None else b""
        checksums = torch_archive.parse_checksums(raw) if stored is not None else None
        if checksums is not None and checksums.get(rec.name) != _crc32c(data):
            raise ArchiveError(f"{rec.name} does not match its recorded CRC32C: "
                                             "the file is corrupted")
        alignment = torch_archive.alignment_of(raw) if checksums is not None else None
        pending = _storage_records(read_at, central, index, alignment)
        sk = torch_pickle.skeleton(data)
        offsets, zip_crcs = [], {}
        for k, s in enumerate(sk.storages):
            r = index.checked(f"data/{s.key}")
            if r.size != s.nbytes:
                raise ArchiveError(f"data/{s.key} holds {r.size} bytes, its "
                                                 f"tensors need {s.nbytes}")
            offsets.append(r.data)
            if r.crc32 or not r.size:  # 0: not recorded (torch's set_crc32_options(False))
                zip_crcs[k] = r.crc32
    except (ArchiveError, pickle.UnpicklingError) as e:
        raise ManifestError(f"{path}: not a torch.save archive gds_persist can read: {e}"
                            ) from None
    writer = torch_archive.writer_of(raw) if raw else {}
    manifest = foreign.torch_manifest(os.path.basename(path), size, sk, offsets, checksums,
                                      writer)
    headers = _HeaderCheck(central, pending) if pending else None
    return manifest, raw + data, data, zip_crcs, headers


def _storage_records(read_at: Callable[[int, int], bytes],
                     central: torch_archive.CentralDirectory, index: torch_archive.ArchiveIndex,
                     alignment: int | None) -> list[torch_archive.Predicted]:
    """Add the storages (data/N) to ``index``; return those whose local header is not read yet.

    Each local header is one scattered read (560 of them: 27 ms of a cold 1 GiB open here). In
    an archive we wrote (``alignment`` from its checksums record) the writer's rule
    (:func:`torch_archive.place`) gives the offsets: the first storage's header confirms it for
    this file (else all are read); the rest are checked on a thread while the data is read."""
    storages = [e for e in central.entries if e.rel.startswith("data/")]
    if alignment is not None and storages:
        first = torch_archive.located(read_at, central, storages[0])
        if first.data == torch_archive.predicted(central, storages[0], alignment).data:
            index.records[first.name] = first
            rest = [(e, torch_archive.predicted(central, e, alignment)) for e in storages[1:]]
            index.records.update((e.rel, rec) for e, rec in rest)
            return rest
    for entry in storages:
        index.records[entry.rel] = torch_archive.located(read_at, central, entry)
    return []


class _HeaderCheck:
    """The local headers of the storages placed by prediction (:func:`_storage_records`), read
    on a thread from :meth:`start` (the data read's start: from the open, its turns at the GIL
    slowed the unpickling after it, 33 ms against 25); :meth:`result` waits for it."""

    def __init__(self, central: torch_archive.CentralDirectory,
                 pending: list[torch_archive.Predicted]):
        self._error: ArchiveError | OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(central, pending), daemon=True,
                                        name="gds_persist-zip-headers")
        self._lock = threading.Lock()
        self._fd = -1

    def start(self, fd: int) -> None:
        """Start reading from a descriptor of its own (a dup of ``fd``, closed when done)."""
        with self._lock:
            if self._thread.ident is None:
                self._fd = os.dup(fd)
                self._thread.start()

    def _run(self, central: torch_archive.CentralDirectory,
             pending: list[torch_archive.Predicted]) -> None:
        try:
            torch_archive.check_predicted(lambda at, n: os.pread(self._fd, n, at), central,
                                          pending)
        except (ArchiveError, OSError) as e:
            self._error = e
        finally:
            os.close(self._fd)

    def result(self, path: str, fd: int) -> None:
        self.start(fd)
        self._thread.join()
        if isinstance(self._error, ArchiveError):
            raise ManifestError(f"{path}: not a torch.save archive gds_persist can read: "
                                f"{self._error}")
        if self._error is not None:
            raise self._error


# A Checkpointer root holds step-N directories and ``latest``, a file naming the newest
# (gds_persist/training/steps.py writes them). This layer knows only their names, to point
# someone who opens the root or the pointer as a checkpoint at what to open instead.
_STEP_NAME = re.compile(r"step-\d+")


def _pointer_target(head: bytes) -> str | None:
    """The step a Checkpointer's ``latest`` names, when ``head`` is such a file's content."""
    text = head.decode("ascii", "replace").strip()
    return text if _STEP_NAME.fullmatch(text) else None


def _root_hint(path: str) -> str:
    """What to load instead when the directory ``path`` is a Checkpointer root; "" if not."""
    try:
        names = os.listdir(path)
    except OSError:
        return ""
    steps = sorted(n for n in names if _STEP_NAME.fullmatch(n)
                   and os.path.isfile(os.path.join(path, n, MANIFEST_NAME)))
    if not steps:
        return ""
    return (f"but a Checkpointer root holding {len(steps)} committed step(s), {steps[0]} to "
            f"{steps[-1]}: load the newest with gds_persist.Checkpointer({path!r}).load(), or "
            f"name one step ({os.path.join(path, steps[-1])}; gds-persist verify takes it too)")


def replaced_message(path: str, why: str) -> str:
    """The words of a :class:`CheckpointReplacedError`; ``why``: "replaced" or "removed"."""
    if why == "removed":
        return (f"{path} was removed by another process (a Checkpointer's retention, or a "
                "delete) while this process was opening it; there is nothing to load there now")
    return (f"{path} was replaced by another process's save while this process was opening "
            "it; load it again (it now holds the newer checkpoint)")


def _open_once(path: str, last_try: bool) -> OpenCheckpoint:
    refuse_url(path)
    if is_temporary(path):
        raise NotCommittedError(
            f"{path} is the temporary directory of an interrupted or running save, not a "
            "committed checkpoint; load the checkpoint path itself"
        )
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not last_try and os.path.lexists(commit_lock_path(path)):
            # a commit without RENAME_EXCHANGE empties the path for a moment
            raise CheckpointReplacedError(replaced_message(path, "replaced")) from None
        raise NotCommittedError(
            f"{path} does not exist: it is not a committed gds_persist checkpoint (an "
            "interrupted save leaves only a hidden .NAME.tmp-* sibling)"
        ) from None
    except NotADirectoryError:
        return open_file(path)
    except PermissionError as e:
        raise CheckpointPermissionError(
            errno.EACCES, f"this process may not read the checkpoint {path} ({e.strerror}): "
            "run as its owner or make it readable") from e
    try:
        try:
            fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            held = os.fstat(dir_fd)
            try:
                now = os.stat(path)
                same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
            except FileNotFoundError:
                same = False
            if not same:
                raise CheckpointReplacedError(replaced_message(path, "replaced")) from None
            hf = open_model_directory(path, dir_fd)
            if hf is not None:
                return hf
            raise NotCommittedError(
                f"{path} has no manifest.json: it is not a committed gds_persist checkpoint "
                + (_root_hint(path) or "(an interrupted save leaves only a hidden "
                   ".NAME.tmp-* sibling)")
            ) from None
        raw = _read_and_close(fd)
        manifest = parse_manifest(raw, os.path.join(path, MANIFEST_NAME))
        return OpenCheckpoint(path, dir_fd, raw, manifest)
    except BaseException:
        os.close(dir_fd)
        raise


def pause(attempt: int) -> None:
    """The wait before opening a replaced checkpoint again."""
    time.sleep(min(0.002 * (2 ** attempt), 0.1))


def open_checkpoint(path: str | os.PathLike[str], data_dirs: Any = None) -> OpenCheckpoint:
    """Open the committed checkpoint at ``path`` (its directory and manifest); data files are
    opened by :meth:`OpenCheckpoint.open_files`. Raises :class:`NotCommittedError` /
    :class:`ManifestError` for what is not a valid committed checkpoint."""
    path = os.fspath(path)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            ck = _open_once(path, attempt == OPEN_ATTEMPTS - 1)
        except CheckpointReplacedError:
            if attempt == OPEN_ATTEMPTS - 1:
                raise
            pause(attempt)
            continue
        try:
            ck.set_data_dirs(data_dirs)
        except BaseException:
            ck.close()
            raise
        return ck
    raise AssertionError("unreachable")


def opened(path: str | os.PathLike[str], use: Callable[[OpenCheckpoint], T],
           data_dirs: Any = None) -> T:
    """``use(checkpoint)`` on the checkpoint at ``path`` held open, closed afterwards. ``use``
    opens the data files it needs before reading any; if the checkpoint was replaced before it
    could, it is opened again and ``use`` runs again (at most ``OPEN_ATTEMPTS`` times in all),
    so ``use`` must not have done anything by then that it cannot repeat."""
    path = os.fspath(path)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            ck = open_checkpoint(path, data_dirs)
        except NotCommittedError:
            if attempt:  # it was there a moment ago
                raise CheckpointReplacedError(replaced_message(path, "removed")) from None
            raise
        try:
            return use(ck)
        except CheckpointReplacedError:
            if attempt == OPEN_ATTEMPTS - 1:
                raise
        finally:
            ck.close()
        pause(attempt)
    raise AssertionError("unreachable")


def _read_and_close(fd: int) -> bytes:
    """All of an open file's bytes from its current offset; the descriptor is closed."""
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
