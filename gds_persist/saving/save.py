"""``save``: the entry point. It checks its arguments once (:class:`.options.SaveRequest`) and
runs the save sequence (:mod:`.sequence`) with the layout of the format asked for: a checkpoint
directory (:mod:`.directory`) or one torch.save file (:mod:`.torch_file`)."""

from __future__ import annotations

import os
from typing import Any

from ..progress import ProgressCallback
from ..results import SaveInfo
from .directory import DirectoryLayout
from .options import SaveRequest
from .sequence import run_save
from .torch_file import TorchFileLayout


def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    block_bytes: int | None = None,
    staging_bytes: int | None = None,
    io_threads: int | None = None,
    progress: ProgressCallback | None = None,
    process_group: Any = None,
    rank_local: Any = None,
    writers_per_node: int | None = None,
    data_dirs: Any = None,
    check_replicas: str = "structure",
    allow_pickle: bool = False,
    base: str | os.PathLike[str] | None = None,
    compression: str | None = None,
    content_hash: bool | None = None,
    format: str = "directory",
) -> SaveInfo:
    """Write ``state_dict`` to the checkpoint directory ``path``, durably and atomically.

    ``backend`` is ``"auto"`` (default, or ``$GDS_PERSIST_BACKEND``), ``"direct"``,
    ``"buffered"`` or ``"kvikio"``. An existing checkpoint at ``path`` is replaced only once the
    new one is complete and fsynced; if anything fails, it is left as it was.

    Several processes may save to (and load from) one ``path`` at once: each save writes its own
    temporary directory, the commits take turns (each waits at most ``io_timeout_s`` for another
    one to finish committing, then raises :class:`CheckpointTimeout` naming it), and the last
    to commit wins - the path always holds one complete checkpoint, and every save that returned
    was committed (possibly replaced since). A save never removes another live save's files;
    leftovers of killed saves are removed by a later save once their owner is gone. Loads that
    overlap a replacement read one complete checkpoint (``docs/FORMAT.md``, "Several processes,
    one path").

    ``progress(done_bytes, total_bytes)``, if given, is called as data files are written (see
    :mod:`gds_persist.progress`).

    Data-parallel (``docs/DISTRIBUTED.md``): with ``process_group`` (a ``torch.distributed`` group,
    or ``"default"``), every rank of the group calls ``save`` with its replica of the state; each
    writes a disjoint, byte-balanced share and rank 0 commits. ``rank_local`` marks key paths
    (``"optimizer"`` or ``("optimizer", "state")``, or a list of them) whose subtrees differ per
    rank (ZeRO shards): written by their owner only. ``writers_per_node`` (default: every rank)
    limits the writing ranks per node; ``data_dirs`` stripes each node's files over several
    directories (one per drive). ``check_replicas`` compares the replicated state across ranks:
    ``"structure"`` (keys, dtypes, shapes, sizes; default), ``"checksums"`` (also the bytes) or
    ``"off"``. Returns a :class:`~gds_persist.results.DistributedSaveInfo` then;
    ``progress`` then counts this rank's own bytes.

    Internally ``state_dict`` may also be a :class:`~gds_persist.state.flatten.Flattened` (what
    ``flatten`` returns): it is written as is, all of it replicated; or, with a process group,
    a :class:`~gds_persist.state.rank_local.Split` (the replicated and the rank-local part, each
    flattened). The Checkpointer flattens each state dict once, when its ``save`` is called, and
    its snapshots are Flattened records over host copies.

    Leaves beyond tensors and JSON scalars (numpy arrays and scalars, bytes, pathlib paths, enums,
    dict/list/tuple subclasses, namespaces) are stored by value (format version 3,
    docs/FORMAT.md). ``allow_pickle=True`` stores any other object pickled; ``load`` unpickles
    it only with ``torch.load(weights_only=True)`` (no code runs; allow classes with
    ``torch.serialization.add_safe_globals``). Single-process saves only: replicas of a pickle
    need not be byte-identical across ranks.

    Writing fewer bytes (format version 4, docs/FORMAT.md): ``base`` names an earlier checkpoint
    in the same parent directory; every unit of a storage (up to 16 MiB of it) whose key path,
    byte range and BLAKE3-128 content hash equal the base's is not written again - the new
    checkpoint refers to the base's bytes (or to the checkpoint the base itself refers to).
    ``content_hash`` (default: True with a base) records the hashes that let this checkpoint
    serve as a base later; a base saved without them (a plain save) holds nothing to refer to:
    every byte is written again, with an :class:`~gds_persist.UnhashedBaseWarning` and the
    same words in ``SaveInfo.reason``. (Plain saves do not hash: on the development VM that
    cost 1.4-1.5x the save's own time, ``bench/bench_hash_cost.py``.)
    ``compression``: ``"none"`` (default, or the ``compression`` setting), ``"lossless"``
    (each unit stored encoded by blosc2 bit-shuffle + LZ4 where that shrinks it) or ``"auto"``
    (only where measured to make this save faster on this drive; the reason is in
    ``SaveInfo.compression_reason``). Loads return bit-identical tensors either way.

    ``format="torch"``: ``path`` is one file in ``torch.save``'s format, which stock
    ``torch.load`` (``weights_only=True``, ``mmap=True``) reads bit-exactly and any tool that
    opens ``.pt`` / ``.ckpt`` files takes; written by the same engine (aligned O_DIRECT or
    kvikio, CRC32C of every storage in a record torch ignores, atomic), and read back, verified,
    by :func:`gds_persist.load` (:mod:`gds_persist.saving.torch_file`). With ``process_group``
    the ranks write byte ranges of the one file. The state holds what
    ``torch.load(weights_only=True)`` reads unless ``allow_pickle=True``; ``base``,
    ``compression``, ``content_hash``, ``rank_local`` and ``data_dirs`` need the directory
    format.

    Raises TypeError (naming the key path) for objects a checkpoint cannot hold,
    :class:`DiskFullError` when the filesystem is too small, :class:`BackendError` for an unusable
    backend, :class:`CheckpointTimeout` when another process's commit of ``path`` hangs,
    :class:`DistributedError` (on every rank, naming the failed rank) when a rank fails.
    """
    options = SaveRequest(
        backend=backend, block_bytes=block_bytes, staging_bytes=staging_bytes,
        io_threads=io_threads, progress=progress, process_group=process_group,
        rank_local=rank_local, writers_per_node=writers_per_node, data_dirs=data_dirs,
        check_replicas=check_replicas, allow_pickle=allow_pickle, base=base,
        compression=compression, content_hash=content_hash, format=format)
    path = os.path.abspath(os.fspath(path))
    layout = (TorchFileLayout(state_dict, path, options) if options.format == "torch"
              else DirectoryLayout(state_dict, path, options))
    return run_save(layout, path, cfg=options.cfg, process_group=options.process_group)
