"""``save(state, directory, format="safetensors")``: a model's weights in the Hugging Face layout,
written by the engine.

The directory gets ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` beyond
``max_shard_size`` with ``model.safetensors.index.json``, which ``safetensors.torch.load_file``,
``safe_open`` and ``from_pretrained`` read unchanged. Each file's header (``{"format": "pt"}``
and the CRC32C of every tensor in ``__metadata__``) is padded with spaces to a 4096-byte
boundary, so the data buffer - the tensors one after another, no holes - starts aligned and is
written as any checkpoint's data: O_DIRECT from the bounded staging ring, or with kvikio from
device memory, each tensor's CRC32C computed on the way. The headers (their CRC32C now known)
are written last, over the space they were sized for.

The save is a directory save (:mod:`gds_persist.transfer.commit`): the files are written into a
temporary directory beside the path, fsynced, and swapped in whole; a failed save leaves the
previous model. Other files of a directory being replaced (``config.json``, a tokenizer's) are
carried into the new one (hard links), except the model files a new save replaces.

Tied weights, as ``save_pretrained`` handles them: tensors that are the same view of one storage
are stored once (under the first name) and the other names recorded in ``__metadata__``; a load
by gds_persist gives them one storage again, ``from_pretrained`` ties them from the model's
config, and ``load_file`` returns the stored name only.

With a process group every rank holds the same state; the writers each write an aligned byte
range of every file, and rank 0 writes the headers and commits, as for one torch.save file
(:mod:`.torch_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import settings
from ..errors import ReplicationError
from ..format import ALIGNMENT, MANIFEST_NAME, Extent, align_up, joined_crcs
from ..format.layout import FilePlan
from ..format.safetensors import (
    INDEX_NAME,
    ST_DTYPES,
    TIED_KEY,
    StTensor,
    aligned_header,
    index_json,
    is_model_file,
    shard_names,
)
from ..progress import ByteCounter
from ..results import DistributedSaveInfo, SaveInfo
from ..transfer.commit import Temporary, check_replaceable, fsync_path, make_temporary
from ..transfer.writer import write_plan
from .options import SaveRequest
from .sequence import Layout, Run
from .torch_file import TOKEN, Facts, Report, _clip, _cut, _sees  # as for one torch.save file
from .units import backend_for, with_fallback

DEFAULT_MAX_SHARD = "50GB"  # save_pretrained's default


@dataclass
class Stored:
    """One stored tensor: its bytes (from :attr:`start` of its storage) at ``begin`` of the data
    buffer of file ``file``."""

    name: str
    tensor: torch.Tensor  # contiguous
    file: int
    begin: int

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def start(self) -> int:
        """Where its bytes begin in its storage."""
        return int(self.tensor.storage_offset()) * self.tensor.element_size()

    @property
    def st(self) -> StTensor:
        return StTensor(self.name, self.tensor.dtype, tuple(self.tensor.shape), self.begin,
                        self.begin + self.nbytes)


def plan_model(state: Any, max_shard: int) -> tuple[list[Stored], dict[str, str], int]:
    """The stored tensors of the flat mapping ``state`` in its order, cut into files of at most
    ``max_shard`` tensor bytes (a larger tensor gets a file of its own); the tied names
    {name: stored name}; the number of files."""
    if not hasattr(state, "items"):
        raise TypeError(f"format='safetensors' saves a flat mapping of tensors (a model's state "
                        f"dict), not {type(state).__name__}")
    stored: list[Stored] = []
    ties: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    file, used = 0, 0
    for name, t in _aligned_first(state):
        _check_leaf(name, t)
        view = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape),
                t.stride(), t.dtype)
        if t.numel() and view in seen:
            ties[name] = seen[view]
            continue
        seen[view] = name
        t = t.detach()
        t = t if t.is_contiguous() else t.contiguous()
        n = t.numel() * t.element_size()
        if used and used + n > max_shard:
            file, used = file + 1, 0
        stored.append(Stored(name, t, file, used))
        used += n
    return stored, ties, file + 1


def _aligned_first(state: Any) -> list[tuple[Any, Any]]:
    """The items, those of a multiple of 4096 bytes first (in order), then the others: the
    tensors after the aligned data start stay at aligned offsets as long as possible, written
    from their own memory rather than copied through the ring (the format has no holes to pad
    with, and its readers do not depend on the order)."""
    items = list(state.items())

    def odd(item: tuple[Any, Any]) -> bool:
        t = item[1]
        return not isinstance(t, torch.Tensor) or (t.numel() * t.element_size()) % ALIGNMENT != 0

    return sorted(items, key=odd)


def _check_leaf(name: Any, t: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"format='safetensors' names tensors by strings; key {name!r} is a "
                        f"{type(name).__name__}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"format='safetensors' saves a flat mapping of tensors, but {name!r} "
                        f"holds a {type(t).__name__}; flatten nested state (a model's "
                        "state_dict() is flat) or use format='directory'")
    if t.dtype not in ST_DTYPES:
        raise TypeError(f"{name!r} has dtype {t.dtype}, which safetensors has no code for; use "
                        "format='torch' or format='directory'")


class SafetensorsLayout(Layout[Facts, Report]):
    """A Hugging Face model directory of the flat mapping ``state`` (see the module docstring)."""

    facts_type, report_type = Facts, Report

    def __init__(self, state: Any, path: str, request: SaveRequest,
                 max_shard_size: int | str | None = None):
        self.state, self.path, self.request = state, path, request
        size = DEFAULT_MAX_SHARD if max_shard_size is None else max_shard_size
        self.max_shard = settings.parse_size(size, "max_shard_size")
        self.writers: list[int] = [0]

    def prepare(self, run: Run) -> Facts:
        self.stored, self.ties, self.nfiles = plan_model(self.state, self.max_shard)
        if run.comm.size == 1:
            return Facts("")
        described = repr([(s.name, str(s.tensor.dtype), tuple(s.tensor.shape), s.file)
                          for s in self.stored] + sorted(self.ties.items()))
        return Facts(hashlib.sha256(described.encode()).hexdigest())

    def begin(self, run: Run) -> Temporary:
        replaceable_model(self.path, True)
        tmp = make_temporary(self.path, run.cfg.io_timeout_s)
        tmp.replaceable = replaceable_model
        carry_files(self.path, tmp.dir)
        return tmp

    def plan(self, run: Run, facts: list[Facts]) -> None:
        bad = {r: "its state has other names, dtypes or shapes than rank 0's"
               for r, f in enumerate(facts) if f.digest != facts[0].digest}
        if bad:
            raise ReplicationError(
                f"{run.what}: format='safetensors' with a process group writes one model of the "
                f"replicated state, but ranks {sorted(bad)} hold a different one" + run.intact,
                failed_ranks=bad, phase="prepare")
        self.names = shard_names(self.nfiles)
        self.meta = {"format": "pt"} | ({TIED_KEY: _json(self.ties)} if self.ties else {})
        blank = [aligned_header(self._of(f), self.meta, None, ALIGNMENT)
                 for f in range(self.nfiles)]
        self.data_start = [len(h) for h in blank]
        ends = [self.data_start[f] + sum(s.nbytes for s in self.stored if s.file == f)
                for f in range(self.nfiles)]
        self.sizes = ends
        self.files = [FilePlan(self.names[f], align_up(ends[f]), tuple(
            Extent(k, s.start, s.nbytes, f,
                   self.data_start[f] + s.begin)
            for k, s in enumerate(self.stored) if s.file == f and s.nbytes))
            for f in range(self.nfiles)]
        run.needs = f"this model needs about {sum(ends)} bytes; "
        self.directory = run.first.tmp
        if run.comm.size > 1:  # rank 0 makes the files at their full size and a token beside
            run.agree("start", lambda: self._start(run) if run.tmp is not None else None)
            sees = run.agree("find", lambda: _sees(self.directory, run.first.save_id))
            self.writers = [r for r, seen in enumerate(sees) if seen]

    def _of(self, f: int) -> list[StTensor]:
        return [s.st for s in self.stored if s.file == f]

    def _sources(self) -> list[torch.UntypedStorage]:
        return [s.tensor.untyped_storage() for s in self.stored]

    def _start(self, run: Run) -> None:
        be, _ = backend_for(run.cfg, self.directory, self._sources())
        for f in self.files:
            be.close(be.open(os.path.join(self.directory, f.name), write=True, size=f.size))
        with open(os.path.join(self.directory, TOKEN), "w") as out:
            out.write(run.first.save_id)

    def write(self, run: Run) -> Report:
        t0 = time.perf_counter()
        if run.comm.rank not in self.writers:
            return Report([], 0, "none", "this rank does not see the model's filesystem: "
                          "nothing to write", 0.0)
        k, n = self.writers.index(run.comm.rank), len(self.writers)
        mine = []
        for f in self.files:  # every writer an aligned byte range of every file
            lo, hi = _cut(f.size, n, k), _cut(f.size, n, k + 1)
            mine.append(replace(f, extents=tuple(_clip(e, lo, hi) for e in f.extents
                                                 if e.offset < hi and e.offset + e.length > lo)))
        sources = self._sources()
        be, reason = backend_for(run.cfg, self.directory, sources)
        total = sum(e.length for f in mine for e in f.extents)
        counter = ByteCounter(self.request.progress, total)
        sealed = write_plan(be, self.directory, mine, sources, run.cfg, counter.hook,
                            create=run.comm.size == 1)
        counter.finish()
        return Report(sealed, total, be.name, with_fallback(be, reason),
                      time.perf_counter() - t0)

    def seal(self, run: Run, reports: list[Report]) -> dict[str, bytes]:
        """The headers (with every tensor's CRC32C) and the index, by file name."""
        starts = [s.start for s in self.stored]
        joined = joined_crcs([(e.storage, e.start - starts[e.storage], e.length, e.crc32c)
                              for r in reports for e in r.pieces],
                             [s.nbytes for s in self.stored])
        crcs = {s.name: c or 0 for s, c in zip(self.stored, joined, strict=True)}
        out = {self.names[f]: aligned_header(self._of(f), self.meta, crcs, ALIGNMENT)
               for f in range(self.nfiles)}
        assert all(len(out[self.names[f]]) == self.data_start[f] for f in range(self.nfiles))
        if self.nfiles > 1:
            weight_map = {s.name: self.names[s.file] for s in self.stored}  # as HF: no ties
            out[INDEX_NAME] = index_json(sum(s.nbytes for s in self.stored), weight_map, {})
        return out

    def commit(self, run: Run, sealed: Any) -> None:
        assert isinstance(run.tmp, Temporary)  # a local directory (URLs are refused by save)
        for f, name in enumerate(self.names):
            _finish_file(os.path.join(run.tmp.dir, name), sealed[name], self.sizes[f])
        if INDEX_NAME in sealed:
            _finish_file(os.path.join(run.tmp.dir, INDEX_NAME), sealed[INDEX_NAME],
                         len(sealed[INDEX_NAME]))
        try:
            os.unlink(os.path.join(run.tmp.dir, TOKEN))
        except FileNotFoundError:
            pass
        fsync_path(run.tmp.dir)
        # the commit lock stays held until the sequence ends (run_save finishes the temporary)
        run.tmp.swap_in(run.cfg.io_timeout_s, True)

    def info(self, run: Run) -> SaveInfo:
        mine = run.reports[run.comm.rank]
        payload = sum(s.nbytes for s in self.stored)
        files = self.names + ([INDEX_NAME] if self.nfiles > 1 else [])
        common = dict(path=self.path, backend=mine.backend, reason=mine.reason,
                      bytes_written=sum(self.sizes), payload_bytes=payload,
                      seconds=time.perf_counter() - run.t0,
                      tensors=len(self.stored) + len(self.ties), storages=len(self.stored),
                      files=files)
        if not self.request.data_parallel:
            return SaveInfo(**common)
        return DistributedSaveInfo(**common, rank=run.comm.rank, world_size=run.comm.size,
                                   writers=self.writers, rank_bytes=mine.bytes,
                                   rank_files=self.names if mine.bytes else [],
                                   rank_write_seconds=mine.seconds)


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _finish_file(path: str, head: bytes, size: int) -> None:
    """Write ``head`` at the start of ``path`` (the space it was sized for), cut the file to
    ``size`` (the data written in aligned blocks ends after it) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def replaceable_model(path: str, replace: bool = True) -> None:
    """What a model directory's save may replace: nothing, a checkpoint, or a directory of
    plain files only (a Hugging Face model's: all but its model files are carried over, so
    nothing is lost); a directory with subdirectories is refused."""
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            if all(os.path.isfile(os.path.join(path, n)) for n in os.listdir(path)):
                return
        except FileNotFoundError:
            return
    check_replaceable(path, replace)


def carry_files(path: str, tmp_dir: str) -> None:
    """Hard-link (or copy) the plain files of the directory being replaced into the new one,
    but for its model files; a gds_persist checkpoint directory is replaced whole."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if is_model_file(name) or not os.path.isfile(src) or os.path.islink(src):
            continue
        try:
            os.link(src, os.path.join(tmp_dir, name))
        except OSError:  # another filesystem's mount inside, or no hard links there
            shutil.copy2(src, os.path.join(tmp_dir, name))
