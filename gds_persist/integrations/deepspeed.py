"""DeepSpeed: ``engine.save_checkpoint`` / ``load_checkpoint`` through gds_persist
(docs/INTEGRATIONS.md).

::

    from gds_persist.integrations import deepspeed as gds_deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=opt,
                                                           config=config)
    gds_deepspeed.attach(engine)                 # every rank, right after initialize
    engine.save_checkpoint("ckpt", tag="step-100")   # committed (decoupled: queued)
    gds_deepspeed.flush(engine)                      # decoupled: wait until it is committed
    engine.load_checkpoint("ckpt")                   # the tag ``latest`` names

:func:`attach` replaces ``engine.checkpoint_engine`` with a :class:`GdsPersistCheckpointEngine`.
Every file keeps DeepSpeed's name and is a ``torch.save`` archive
(``gds_persist.save(..., format="torch")``): aligned O_DIRECT (or kvikio) writes from the
bounded staging ring, a CRC32C per storage, committed atomically (temporary sibling, fsync,
rename, directory fsync). So ``torch.load``, ``zero_to_fp32``, universal checkpoints and every
other DeepSpeed tool read them as before, and gds_persist verifies them on load.

Trust: DeepSpeed's states hold Python objects beyond tensors (``LossScaler``,
``ZeroStageEnum``, ``fragment_address``, the config): they ride in the archive's pickle
(``allow_pickle=True``) and :meth:`~GdsPersistCheckpointEngine.load` unpickles them
(``weights_only=False``), as DeepSpeed's own engines do. Load trusted checkpoints only.

Decoupled or not: :func:`attach` follows the engine's own configuration unless told
otherwise (``decoupled=None``, the default): decoupled where the DeepSpeed config sets
``checkpoint.writer.decoupled``, else not, as stock DeepSpeed saves. Not decoupled,
``save_checkpoint`` returns once every rank's files are durable and ``latest`` names the tag,
as with stock DeepSpeed. Decoupled, ``save`` pickles the state's Python objects at once and
queues the write of its tensors on one background thread, after copying every tensor that
``engine.step()`` does not hold back (buffers such as BatchNorm's statistics, ``client_state``;
:mod:`gds_persist.training.capture`), so the files hold the state as it was at
``save_checkpoint``, checked at the commit; when
``save_checkpoint`` returns, the commit (every rank's files durable, then ``latest`` written
atomically by rank 0) is queued behind the writes, so the checkpoint becomes visible as soon
as its bytes are durable, while the next step runs. The next ``engine.step()`` waits for that
commit before the optimizer changes a tensor. :func:`flush` waits for it explicitly (every
rank); ``load_checkpoint``, ``engine.destroy()``, the next ``save_checkpoint`` and a normal
interpreter exit flush first, so the last checkpoint of a run is never lost. Every wait is
bounded (``timeout_s`` for this rank's writes, ``collective_timeout_s`` for the other ranks).
A SIGKILL at any instant leaves ``latest`` naming a tag whose files are complete.

A failure anywhere (a write, a full disk, a dead peer) is raised on every rank, by ``commit``
(``save_checkpoint`` or the next ``engine.step()``), naming the rank and file; ``latest`` is
then not written, so it still names the previous tag, whose files are untouched.

Data-parallel writing (``data_parallel=True``, FastPersist's ``optimize_dp_state``): with ZeRO
0-2 every data-parallel rank holds the same model-states file (``mp_rank_00_model_states.pt``,
which DeepSpeed has dp rank 0 write alone). Here every rank takes part: each writes an aligned
byte range of the one file (``gds_persist.save(..., format="torch", process_group=...)``).
Where the replicas' pickles differ (e.g. a rank-specific ``client_state``, or tensors on
``cuda:0`` and ``cuda:1``) dp rank 0 writes it alone, as DeepSpeed does. Not split: ZeRO-3
(each rank writes its own files), MoE, pipeline or model parallelism and node-local storage
(:attr:`GdsPersistCheckpointEngine.split_reason` says why).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
import weakref
import zipfile
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from .. import settings
from ..format.torch_pickle import replica_digest
from ..keywords import as_settings, refuse_moved
from ..loading.load import load as gds_load
from ..loading.options import LoadOptions
from ..parallel.distributed import background_group, make_comm
from ..results import DistributedSaveInfo, SaveInfo
from ..saving.save import save as gds_save
from ..saving.torch_file import PickledState
from ..training.at_exit import finish_at_exit
from ..training.background_writer import Lane, collect, finished
from ..training.capture import Capture, StorageId, fingerprints, held_by, storage_id
from ..transfer.atomic_file import AtomicFile
from ..transfer.commit import fsync_path

log = logging.getLogger("gds_persist")
__all__ = ["SAVE_OPTIONS", "GdsPersistCheckpointEngine", "attach", "flush"]

SAVE_OPTIONS = frozenset({"backend"})
# the file every data-parallel rank of ZeRO 0-2 holds alike (DeepSpeed's _get_ckpt_name)
SHARED_FILE = re.compile(r"mp_rank_\d+_model_states\.pt")
# ZeRO 1-2 optimizers' flat buffers, which the optimizer step alone changes
ZERO_FLAT_TENSORS = ("single_partition_of_fp32_groups", "bit16_groups_flat")
KNOB = "attach(engine, timeout_s=...)"  # what raises the bound on every wait for a write


def attach(engine: Any, *, decoupled: bool | None = None, data_parallel: bool = True,
           timeout_s: float = 1800.0, **save_options: Any) -> GdsPersistCheckpointEngine:
    """Route ``engine.save_checkpoint`` / ``load_checkpoint`` through gds_persist (see the
    module docstring). Every rank calls it (it creates a process group), right after
    ``deepspeed.initialize``; a second call returns the engine already attached.

    Parameters
    ----------
    engine
        What ``deepspeed.initialize`` returned first.
    decoupled
        None (default) follows the engine's config (``checkpoint.writer.decoupled``); True
        returns from ``save_checkpoint`` before the bytes are written; False once committed.
    data_parallel
        Let the data-parallel ranks share the write of the model-states file.
    timeout_s
        Bound on every wait for this rank's writes.
    save_options
        :func:`gds_persist.save` keywords (:data:`SAVE_OPTIONS`).

    Returns
    -------
    GdsPersistCheckpointEngine
        The new checkpoint engine, also ``engine.checkpoint_engine``.

    Raises
    ------
    TypeError
        ``engine`` is not a DeepSpeed engine, or an option is unknown.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"attach: {type(engine).__name__} is not a DeepSpeed engine; pass the "
                        "engine deepspeed.initialize returned (its first value)")
    old = engine.checkpoint_engine
    if isinstance(old, GdsPersistCheckpointEngine):
        return old
    reason = "requested explicitly"
    if decoupled is None:
        decoupled, reason = configured_decoupling(engine)
    ours = GdsPersistCheckpointEngine(decoupled=decoupled, timeout_s=timeout_s, **save_options)
    ours.decoupled_reason = reason
    ours.split_reason = _split_refusal(engine, data_parallel, ours.group)
    ours.held = functools.partial(_held_by_engine, weakref.ref(engine))
    if not ours.split_reason:
        engine.save_non_zero_checkpoint = True  # every dp rank writes its range of the file
    if old is not None and old.is_decoupled():
        old.cleanup()  # DeepSpeed's decoupled engine leaves its process running otherwise
    engine.checkpoint_engine = ours
    _flush_at_the_edges(engine, ours)
    return ours


def flush(engine: Any) -> None:
    """Block until the last ``save_checkpoint`` of ``engine`` is committed: every rank's files
    durable, ``latest`` naming its tag. Every rank calls it. Only decoupled saves need it: not
    decoupled, ``save_checkpoint`` returns committed.

    Parameters
    ----------
    engine
        A DeepSpeed engine given to :func:`attach`.

    Raises
    ------
    TypeError
        :func:`attach` was not called on ``engine``.
    CheckpointError
        The save failed on some rank (raised on every rank, naming it);
        :class:`~gds_persist.CheckpointTimeout` when a wait ran past its bound.
    """
    ours = engine.checkpoint_engine
    if not isinstance(ours, GdsPersistCheckpointEngine):
        raise TypeError(f"flush: {type(ours).__name__} is not gds_persist's checkpoint engine; "
                        "call gds_persist.integrations.deepspeed.attach(engine) first")
    ours.flush()


def configured_decoupling(engine: Any) -> tuple[bool, str]:
    """Whether the engine's own configuration asks for decoupled checkpointing.

    Parameters
    ----------
    engine
        A DeepSpeed engine.

    Returns
    -------
    tuple[bool, str]
        Decoupled or not, and why (the ``decoupled_reason`` :func:`attach` records).
    """
    from deepspeed.runtime.model_checkpointing.constants import (
        CHECKPOINT_WRITER,
        CHECKPOINT_WRITER_DECOUPLED,
    )

    writer = (getattr(engine._config, "checkpoint_config", None) or {}).get(CHECKPOINT_WRITER)
    if writer and writer.get(CHECKPOINT_WRITER_DECOUPLED):
        return True, "the DeepSpeed config sets checkpoint.writer.decoupled"
    return False, ("the DeepSpeed config does not set checkpoint.writer.decoupled: "
                   "save_checkpoint returns once the checkpoint is committed, as stock "
                   "DeepSpeed's does")


def _held_by_engine(engine_ref: Callable[[], Any]) -> set[StorageId]:
    """What ``engine.step()`` changes only after it committed the pending save: the module's
    parameters and the optimizer's tensors (its state, ZeRO's flat partitions). A decoupled save
    reads them live; everything else (buffers, tensors in ``client_state``) is copied at save."""
    engine = engine_ref()
    if engine is None:
        return set()
    held = {storage_id(p.untyped_storage()) for p in engine.module.parameters()}
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    held |= held_by([o for o in (optimizer, inner) if isinstance(o, torch.optim.Optimizer)])
    for name in ZERO_FLAT_TENSORS:
        held.update(storage_id(t.untyped_storage()) for t in getattr(optimizer, name, None) or []
                    if isinstance(t, torch.Tensor))
    return held


def _flush_at_the_edges(engine: Any, ours: GdsPersistCheckpointEngine) -> None:
    """``save_checkpoint`` queues the commit behind its writes; ``load_checkpoint`` first
    commits what is pending (the tag it reads from ``latest`` is then the newest). Instance
    attributes over the engine's methods: DeepSpeed gives a checkpoint engine no call at the end
    of ``save_checkpoint`` or the start of ``load_checkpoint``."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        saved = save(*args, **kwargs)
        ours.commit_in_background()
        return saved

    @functools.wraps(load)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        ours.flush()
        return load(*args, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def _split_refusal(engine: Any, wanted: bool, group: Any) -> str:
    """Why the data-parallel ranks do not share the write of the model-states file ("" if
    they do)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    checks = [(not wanted, "data_parallel=False"),
              (group is None, "one process"),
              (engine.zero_optimization_partition_weights(), "ZeRO-3: each rank writes its own "
               "model-states file"),
              (engine.has_moe_layers, "MoE layers: DeepSpeed writes their files per expert"),
              (isinstance(engine, PipelineEngine) or engine.mpu is not None
               or engine.mp_world_size > 1, "pipeline or model parallelism"),
              (engine.use_node_local_storage(), "node-local storage: each node writes a copy")]
    return next((reason for failed, reason in checks if failed), "")


class GdsPersistCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` writing DeepSpeed's files with gds_persist (see the
    module docstring). Without :func:`attach` (no engine) it still saves and loads single files:
    ``create``, ``save`` of each file, ``commit``.

    Parameters
    ----------
    config_params
        DeepSpeed's checkpoint engine argument (unused).
    decoupled
        Write on a background thread (:mod:`gds_persist.training.background_writer`), the
        commit queued behind the writes; False writes in ``save``.
    timeout_s
        Bound on every wait for this rank's writes.
    save_options
        :func:`gds_persist.save` keywords (:data:`SAVE_OPTIONS`); another raises ``TypeError``.

    Call order (DeepSpeed's, every rank): ``create(info)``, ``makedirs``, ``save(state, path)``
    per file, then ``commit(info)`` - at the end of ``save_checkpoint`` (not decoupled) or in the
    next ``engine.step()`` (decoupled, via ``get_commit_info``); ``load(path, map_location)`` per
    file of a ``load_checkpoint``; ``cleanup()`` in ``engine.destroy()``. :func:`attach` adds
    :meth:`commit_in_background` at the end of ``save_checkpoint`` and :meth:`flush` at the start
    of ``load_checkpoint``; a normal interpreter exit flushes too."""

    def __init__(self, config_params: Any = None, *, decoupled: bool = True,
                 timeout_s: float = 1800.0, **save_options: Any):
        super().__init__(config_params)
        self.name = "GdsPersistCheckpointEngine"
        refuse_moved("GdsPersistCheckpointEngine", save_options,
                     as_settings("block_bytes", "staging_bytes", "io_threads"))
        unknown = sorted(set(save_options) - SAVE_OPTIONS)
        if unknown:
            raise TypeError(f"GdsPersistCheckpointEngine: unknown option(s) {unknown}; it takes "
                            f"decoupled, data_parallel, timeout_s and the gds_persist.save "
                            f"keywords {', '.join(sorted(SAVE_OPTIONS))}")
        self.decoupled = decoupled
        self.decoupled_reason = "requested explicitly"
        self.timeout_s = timeout_s
        self.save_options = save_options
        self.split_reason = "no engine attached"
        self.group = background_group(settings.current().collective_timeout_s)
        self.infos: list[SaveInfo] = []  # this rank's writes of the newest committed save
        self._pending: CheckpointCommitInfo | None = None  # created, not yet committed
        self._committing: Future[int] | None = None  # the pending save's queued commit
        self._writes: list[tuple[str, Future[Any]]] = []
        self._lane: Lane | None = None  # decoupled: the writes, then their commit, in order
        self._capture = Capture()
        # what engine.step() holds until the pending save is committed (attach sets it)
        self.held: Callable[[], set[StorageId]] = set
        finish_at_exit(self, GdsPersistCheckpointEngine.cleanup,
                       "DeepSpeed engine: the last checkpoint was not committed")

    # ------------------------------------------------------------------ DeepSpeed's calls

    def is_decoupled(self) -> bool:
        """Whether ``save`` returns before the bytes are written (``decoupled``)."""
        return self.decoupled

    def preserves_storage_sharing(self) -> bool:
        """True: views and tied tensors stay one storage, as in ``torch.save``."""
        return True

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start the save of ``info.tag``; an uncommitted earlier one is committed first.

        Parameters
        ----------
        info
            DeepSpeed's ``CheckpointCommitInfo`` (tag, save directory, ``save_latest``).
        """
        self.flush()
        self._pending = info

    def save(self, state_dict: Any, path: str) -> None:
        """Queue (or, not decoupled, run) the write of ``state_dict`` as the file ``path``: its
        Python objects are pickled now, its tensors written as they are now.

        Parameters
        ----------
        state_dict
            What DeepSpeed saves in that file (tensors and Python objects).
        path
            The file, DeepSpeed's name for it.

        Raises
        ------
        TypeError
            What the state holds cannot be pickled. A failed write is raised by ``commit``.
        """
        path = os.path.abspath(os.fspath(path))
        state, pickled = _detached(state_dict)
        held = self.held()
        if self.decoupled:  # the file holds the state as it is now (training/capture.py)
            state, _ = self._capture(state, held)
        split = (not self.split_reason and SHARED_FILE.fullmatch(os.path.basename(path))
                 is not None)
        write = (self._shared_write(state, path, _replica_digest(pickled, state, held)) if split
                 else self._write(state, path))
        self._submit(path, write)

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state in the file ``path``, once this rank's writes are done. Unpickles
        DeepSpeed's objects: trusted files only.

        Parameters
        ----------
        path
            A file gds_persist wrote (verified), or a stock ``torch.save`` one (DeepSpeed's own
            engine: unverified; a legacy non-zip one through ``torch.load``).
        map_location
            As ``torch.load``'s.

        Returns
        -------
        Any
            The state DeepSpeed saved in that file.
        """
        self.wait()  # a file being written is read once it is complete
        if os.path.isfile(path) and not zipfile.is_zipfile(path):
            return torch.load(path, map_location=map_location, weights_only=False)
        return gds_load(path, map_location=map_location,
                        options=LoadOptions(weights_only=False))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Make ``info.tag`` durable on every rank, then (rank 0, ``info.save_latest``) write
        ``save_dir/latest`` atomically. Where the commit was queued by
        :meth:`commit_in_background`, waits for it (bounded).

        Parameters
        ----------
        info
            The ``CheckpointCommitInfo`` of the save to commit.

        Returns
        -------
        bool
            True (DeepSpeed's contract); a failure raises.

        Raises
        ------
        CheckpointError
            A write failed on some rank (on every rank, naming the rank and file; ``latest``
            is left as it was); :class:`~gds_persist.CheckpointTimeout` past the bound.
        """
        self._pending, committing, self._committing = None, self._committing, None
        if committing is None:
            self._commit_now(info, self._take_writes())
        else:
            collect([(f"the commit of DeepSpeed checkpoint {info.tag!r}", committing)],
                    self.timeout_s + settings.current().collective_timeout_s, KNOB)
        # ``latest`` is written (atomically); DeepSpeed's own rewrite of it after a decoupled
        # commit is a plain open-and-write that a kill can leave empty: skip it
        info.save_latest = False
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The save created and not yet committed (None if there is none)."""
        return self._pending

    def cleanup(self) -> None:
        """``engine.destroy()`` (and a normal interpreter exit): commit the pending save, stop
        the writer thread. Raises as :meth:`commit`."""
        try:
            self.flush()
        finally:
            if self._lane is not None:
                self._lane.stop(deadline=time.monotonic())  # a hung write ends it later
                self._lane = None

    # ------------------------------------------------------------------ the edges of a save

    def commit_in_background(self) -> None:
        """Decoupled, at the end of ``save_checkpoint``: queue the pending save's commit behind
        its writes, so it becomes visible once durable, without waiting for ``engine.step()``."""
        info = self._pending
        if info is None or self._committing is not None or not self.decoupled:
            return
        writes = self._take_writes()
        self._committing = self._lane_().submit(functools.partial(self._commit_now, info, writes),
                                                f"committing DeepSpeed checkpoint {info.tag!r}")

    def flush(self) -> None:
        """Commit the pending save (waiting for a queued commit), then wait for any other
        writes; raises as :meth:`commit`. :func:`flush` calls it."""
        if self._pending is not None:
            self.commit(self._pending)
        self.wait()

    def _commit_now(self, info: CheckpointCommitInfo,
                    writes: list[tuple[str, Future[Any]]]) -> int:
        comm = make_comm(self.group, settings.current().collective_timeout_s)
        what = f"gds_persist commit of DeepSpeed checkpoint {info.tag!r} in {info.save_dir}"
        keep = f"; 'latest' in {info.save_dir} was not changed"
        written = comm.agree("durable", lambda: self._finish_writes(writes), what, keep)
        comm.agree("latest", lambda: self._publish(info, comm.rank), what, keep)
        return int(written[comm.rank])

    # ------------------------------------------------------------------ the writes

    def wait(self) -> list[SaveInfo | None]:
        """Block (at most ``timeout_s`` in all) until this rank's queued writes are done.

        Returns
        -------
        list[SaveInfo | None]
            Their infos, in order (None for a file another rank wrote).

        Raises
        ------
        CheckpointError
            The first write's error (the later ones logged and noted on it);
            :class:`~gds_persist.CheckpointTimeout` naming the writes still running.
        """
        return collect(self._take_writes(), self.timeout_s, KNOB)

    def _take_writes(self) -> list[tuple[str, Future[Any]]]:
        writes, self._writes = self._writes, []  # touched by the caller's thread only
        return writes

    def _finish_writes(self, writes: list[tuple[str, Future[Any]]]) -> int:
        """This rank's files durable (each was fsynced and renamed in place, its directory
        fsynced; here the tag directory's entry too); the bytes it wrote."""
        self.infos = [i for i in collect(writes, self.timeout_s, KNOB) if i is not None]
        for tag_dir in sorted({os.path.dirname(i.path) for i in self.infos}):
            fsync_path(os.path.dirname(tag_dir))
        return sum(i.rank_bytes if isinstance(i, DistributedSaveInfo) else i.bytes_written
                   for i in self.infos)

    @staticmethod
    def _publish(info: CheckpointCommitInfo, rank: int) -> None:
        if rank == 0 and info.save_latest:
            with AtomicFile(os.path.join(info.save_dir, "latest")) as fd:
                os.write(fd, str(info.tag).encode())

    def _write(self, state: Any, path: str) -> Callable[[], SaveInfo]:
        return lambda: gds_save(state, path, format="torch", allow_pickle=True,
                                **self.save_options)

    def _shared_write(self, state: Any, path: str,
                      digest: bytes) -> Callable[[], SaveInfo | None]:
        """The write of a file every rank holds: byte ranges by every rank if the replicas'
        pickles (``digest``) are identical, else by rank 0 alone (DeepSpeed's choice)."""

        def run() -> SaveInfo | None:
            comm = make_comm(self.group, settings.current().collective_timeout_s)
            if len(set(comm.all_gather_bytes(digest, "replicas of " + path))) == 1:
                return gds_save(state, path, format="torch", allow_pickle=True,
                                process_group=self.group, **self.save_options)
            if comm.rank == 0:
                log.info("%s: the data-parallel ranks' states differ (client_state? devices?):"
                         " rank 0 writes it alone", path)
                return self._write(state, path)()
            return None
        return run

    def _submit(self, path: str, write: Callable[[], Any]) -> None:
        self._writes.append((path, self._lane_().submit(write, f"writing {path}")
                             if self.decoupled else finished(write)))

    def _lane_(self) -> Lane:
        if self._lane is None:
            self._lane = Lane("deepspeed")
        return self._lane


def _detached(state: Any) -> tuple[Any, bytes]:
    """``state`` pickled now (a later change to a config, a loss scaler or a ZeRO-3 parameter's
    ``.data`` does not reach the file), its tensors' bytes to be written from the live storages
    (no copy), as what ``gds_persist.save`` takes (a flattened pickled state), and the pickle."""
    pickled = PickledState.of(state, allow_pickle=True)
    for device in {e.storage.device for e in pickled.entries if e.storage.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()  # the writer thread reads finished bytes
    return pickled.flattened(), pickled.data


def _replica_digest(pickled: bytes, state: Any, held: set[StorageId]) -> bytes:
    """What the replicas of a shared file must agree on to split its write: the pickle, and
    the bytes of every storage ``engine.step()`` does not keep equal across data-parallel
    ranks - buffers such as BatchNorm's statistics, computed on each rank's own batches."""
    own = [s for s in state.storage_objects if storage_id(s) not in held]
    return (replica_digest(pickled) + repr(fingerprints(own))).encode()
