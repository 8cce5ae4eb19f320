"""PyTorch Lightning: checkpoints through gds_persist with one line (docs/INTEGRATIONS.md).

::

    from gds_persist.integrations.lightning import GdsPersistCheckpointIO

    trainer = Trainer(plugins=[GdsPersistCheckpointIO()],
                      callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss", save_last=True)])
    trainer.fit(model, ckpt_path="checkpoints/last.ckpt")   # resume

Every path Lightning names (``epoch=3-step=400.ckpt``, ``last.ckpt``) becomes one file in
``torch.save``'s format (``format="torch"``, the default): Lightning's own
``LightningModule.load_from_checkpoint``, ``Trainer(ckpt_path=...)``, ``ModelCheckpoint``'s file
handling and every script that ``torch.load``s a ``.ckpt`` keep working, while gds_persist writes
it (aligned O_DIRECT / kvikio, durably and atomically: a save replaces the previous file only
once complete and fsynced) and verifies it on load (a CRC32C per storage, which torch.load does
not check). ``format="directory"`` writes gds_persist checkpoint directories instead (for
``compression=`` and the other directory-only options). ``load_checkpoint`` reads either, and a
stock ``torch.save`` file, so a run started with ``TorchCheckpointIO`` resumes; a save over a
checkpoint of the other kind at the path replaces it. ``remove_checkpoint`` removes it whole.

``background=True``: the checkpoint is flattened and copied into a host snapshot before
``save_checkpoint`` returns, with the Checkpointer's snapshot machinery (one bounded arena, pinned
for CUDA tensors, reused from one save to the next; no second copy of the model in GPU memory):
each storage is copied once, so tied weights and views stay shared, and the manifest records the
device each storage was saved from. The background writer's thread
(:mod:`gds_persist.training.background_writer`) writes it while training goes on. The
arena holds one checkpoint by default (the next save waits for the previous write);
``snapshot_bytes`` sets its size (twice a checkpoint: a save need not wait for the previous
write). ``remove_checkpoint``, ``load_checkpoint`` and ``teardown`` wait for the writes in flight,
so a removal never races a write. Lightning's ``AsyncCheckpointIO`` wrapper also works (it clones
the tensors where they are, then calls this plugin from its thread).

What a file may hold: what ``TorchCheckpointIO`` saves (any picklable object, e.g. a
``pathlib.Path`` hyper-parameter); it loads as Lightning loads it, through torch's weights-only
unpickler unless ``weights_only=False`` is passed (objects beyond tensors and containers need
that, or ``safe_globals``). The options: :class:`GdsPersistCheckpointIO`'s parameters.
``storage_options`` of ``Trainer.save_checkpoint`` may be None or a dict of
:data:`STORAGE_OPTIONS`; anything else raises a ``TypeError`` that lists them.

``LightningModule.load_from_checkpoint(path)`` reads a file with Lightning's own loader (no
verification); :func:`load_from_checkpoint` (``load_from_checkpoint(MyModule, path,
map_location=..., strict=..., hparams_file=..., **overrides)``, the same arguments; a
LightningDataModule class too) reads it through gds_persist, verified, and also reads the
directory format, which Lightning's loader cannot (``IsADirectoryError``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointTimeout
from ..keywords import refuse_moved
from ..loading.load import load
from ..loading.options import LoadOptions
from ..results import SaveInfo
from ..saving.options import FORMATS, MOVED
from ..saving.save import save
from ..saving.torch_file import PickledState
from ..state.flatten import Flattened, flatten
from ..training.background_writer import BackgroundWriter
from ..transfer.commit import fsync_path
from ._common import remove_checkpoint

try:  # the `lightning` package; `pytorch_lightning` alone ships `lightning_fabric`
    from lightning.fabric.plugins import CheckpointIO as _CheckpointIO
    from lightning.fabric.plugins import TorchCheckpointIO as _TorchCheckpointIO
except ImportError:  # pragma: no cover - exercised only without the `lightning` package
    from lightning_fabric.plugins import CheckpointIO as _CheckpointIO  # type: ignore[assignment]
    from lightning_fabric.plugins import (  # type: ignore[assignment]
        TorchCheckpointIO as _TorchCheckpointIO,
    )

log = logging.getLogger("gds_persist")
__all__ = ["STORAGE_OPTIONS", "GdsPersistCheckpointIO", "load_from_checkpoint",
           "pytorch_lightning_checkpoint_io"]
_PICKLE_HINT = "with Lightning: GdsPersistCheckpointIO(allow_pickle=True)"
# gds_persist.save keywords a Lightning save may pass: not those of a process group (Lightning
# saves from global rank zero) nor allow_pickle (the plugin's own option, applied before them)
STORAGE_OPTIONS = frozenset(
    name for name, p in inspect.signature(save).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in {
        "process_group", "rank_local", "writers_per_node", "data_dirs", "check_replicas",
        "allow_pickle", "format"})


def _save_options(options: Any, where: str) -> dict[str, Any]:
    """``options`` checked as ``gds_persist.save`` keywords of a Lightning save."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{where}: storage_options must be None or a dict of gds_persist.save keywords "
            f"({', '.join(sorted(STORAGE_OPTIONS))}), not {type(options).__name__} "
            f"{str(options)[:60]!r}"
        )
    refuse_moved(where, options, MOVED)
    unknown = sorted(str(k) for k in options if k not in STORAGE_OPTIONS)
    if unknown:
        raise TypeError(
            f"{where}: unknown storage option(s) {unknown}; GdsPersistCheckpointIO accepts "
            f"the gds_persist.save keywords {', '.join(sorted(STORAGE_OPTIONS))}"
        )
    return dict(options)


class _GdsPersistCheckpointIO:
    """The plugin's behaviour, shared by the classes for ``lightning`` and ``pytorch_lightning``."""

    _torch_io: Callable[[], Any]  # Lightning's TorchCheckpointIO: it writes and reads URLs

    def __init__(self, *, format: str = "torch", background: bool = False,  # noqa: A002
                 allow_pickle: bool = False, safe_globals: Iterable[Any] = (),
                 verify: bool = True, timeout_s: float = 1800.0,
                 snapshot_bytes: int | None = None, **save_kwargs: Any):
        if format not in FORMATS:
            raise ValueError(f"GdsPersistCheckpointIO(format={format!r}): valid formats are "
                             f"{', '.join(FORMATS)}")
        self.format = format
        self.background = background
        self.allow_pickle = allow_pickle
        self.safe_globals = list(safe_globals)
        self.verify = verify
        self.timeout_s = timeout_s
        self.save_kwargs = _save_options(save_kwargs, "GdsPersistCheckpointIO(...)")
        self._start(snapshot_bytes)

    def _start(self, snapshot_bytes: int | None) -> None:
        """What is the plugin's own and never copied: its locks, writer thread, snapshot arena."""
        self._last_info: SaveInfo | None = None
        self._writer = BackgroundWriter(self._write, snapshot_bytes, self.timeout_s,
                                        "GdsPersistCheckpointIO(timeout_s=...)")
        self._saving = _Saving()

    # A copy (copy.deepcopy, pickle) is a fresh plugin with the same options and its own locks,
    # writer thread and arena (_start): Lightning deep-copies callbacks, whose progress bar
    # holds the trainer and so this plugin, and torch.save(trainer) pickles it. Saves in
    # flight stay the original's.
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_writer", "_saving", "_last_info")}
        return {**state, "_snapshot_bytes": self._writer.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        snapshot_bytes = state.pop("_snapshot_bytes")
        self.__dict__.update(state)
        self._start(snapshot_bytes)

    @property
    def last_info(self) -> SaveInfo | None:
        """The :class:`~gds_persist.SaveInfo` of the newest completed save."""
        return self._writer.last_info if self.background else self._last_info

    # ------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Save Lightning's checkpoint dict at ``path`` (durably, atomically; ``background``:
        from a snapshot, written on the background writer's thread).

        Parameters
        ----------
        checkpoint
            What Lightning saves (any picklable object in the torch format).
        path
            A file (torch format) or directory path; a URL goes to Lightning's
            ``TorchCheckpointIO``.
        storage_options
            None or a dict of :data:`STORAGE_OPTIONS`.

        Raises
        ------
        TypeError
            ``storage_options`` is not one, or the checkpoint holds what cannot be saved
            (naming its key path). A failed background write is raised by the next call.
        """
        if _remote(path):
            self.wait()  # in order with the local saves before it
            self._torch_io().save_checkpoint(checkpoint, path, storage_options)
            return
        path = os.fspath(path)
        with self._saving.of(path):
            self._save(checkpoint, path, storage_options)

    def _save(self, checkpoint: dict[str, Any], path: str, storage_options: Any) -> None:
        # the torch format keeps what Lightning's TorchCheckpointIO keeps: any picklable object
        pickles = self.allow_pickle or self.format == "torch"
        kwargs = {**self.save_kwargs,
                  **_save_options(storage_options, "GdsPersistCheckpointIO.save_checkpoint"),
                  "format": self.format, "allow_pickle": pickles}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:  # a TypeError names what cannot be saved, here (not in the background)
            flat = (PickledState.of(checkpoint, pickles).flattened()
                    if self.format == "torch" else flatten(checkpoint, pickles))
        except TypeError as e:
            if self.allow_pickle or "allow_pickle=True" not in str(e):
                raise
            raise TypeError(f"{e}; {_PICKLE_HINT}") from e
        if self.background:
            self._writer.submit(flat, path, kwargs)
        else:
            self._last_info = self._write(flat, path, kwargs)

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint through gds_persist, after the background saves.

        Parameters
        ----------
        path
            A ``torch.save``-format file (written by this plugin: verified; or by Lightning's
            ``TorchCheckpointIO``), a checkpoint directory, or a URL (``s3://``, read by
            Lightning's ``TorchCheckpointIO``, unverified).
        map_location
            As in ``torch.load``; None: everything on the CPU, as Lightning's.
        weights_only
            As in ``torch.load`` (None: True); a directory never runs code.

        Returns
        -------
        dict
            Lightning's checkpoint dict.

        Raises
        ------
        FileNotFoundError
            Nothing at ``path``.
        CheckpointError
            The file does not hold a checkpoint dict, or fails verification
            (:class:`~gds_persist.ChecksumError`).
        """
        self.wait()
        if _remote(path):
            return self._torch_io().load_checkpoint(  # type: ignore[no-any-return]
                path, **({} if map_location is None else {"map_location": map_location}),
                weights_only=weights_only)
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        safe = (torch.serialization.safe_globals(self.safe_globals) if self.safe_globals
                else contextlib.nullcontext())
        with safe:
            state = load(path, map_location="cpu" if map_location is None else map_location,
                         verify=self.verify,
                         options=LoadOptions(weights_only=weights_only is not False))
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} does not hold a Lightning checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` whole, after the background saves (if any) and a
        save of that path running on another thread (``AsyncCheckpointIO``'s) have finished.

        Parameters
        ----------
        path
            The file, directory or link Lightning names.

        Raises
        ------
        CheckpointError
            ``path`` is a directory that is not a gds_persist checkpoint (refused).
        CheckpointTimeout
            The save of ``path`` on another thread did not finish within ``timeout_s``.
        """
        self.wait()
        if _remote(path):
            self._torch_io().remove_checkpoint(path)
            return
        path = os.fspath(path)
        self._saving.wait_for(path, self.timeout_s)
        if not os.path.lexists(path):
            log.warning("remove_checkpoint: nothing at %s. If its save is still queued in "
                        "Lightning's AsyncCheckpointIO, it will be written after this removal "
                        "and stay on disk; GdsPersistCheckpointIO(background=True) keeps "
                        "removals in order", path)
        remove_checkpoint(path)

    def teardown(self) -> None:
        """Finish the background saves, if any, stop the thread and free the snapshot memory;
        raises as :meth:`wait`."""
        self._writer.close()

    # ------------------------------------------------------------------ background

    def wait(self) -> None:
        """Block until the background saves (if any) are committed.

        Raises
        ------
        CheckpointError
            The first failed save's error (the later ones logged and noted on it);
            :class:`~gds_persist.CheckpointTimeout` when they run past ``timeout_s``.
        """
        self._writer.wait()

    def _write(self, flat: Flattened, path: str, kwargs: dict[str, Any]) -> SaveInfo:
        if os.path.islink(path):  # ModelCheckpoint(save_last="link") left a link here
            os.unlink(path)
        other = os.path.isdir(path) if kwargs["format"] == "torch" else os.path.isfile(path)
        if other:  # a checkpoint of the other kind, e.g. last.ckpt of an earlier run
            return _replace_other_kind(path, lambda p: save(flat, p, **kwargs))
        return save(flat, path, **kwargs)


class _Saving:
    """The paths whose ``save_checkpoint`` is running, on any thread: a removal of one waits
    for it (Lightning's AsyncCheckpointIO saves on its thread and removes on the caller's)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paths: dict[str, int] = {}

    @contextlib.contextmanager
    def of(self, path: str) -> Iterator[None]:
        key = os.path.abspath(path)
        with self._cond:
            self._paths[key] = self._paths.get(key, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._paths[key] -= 1
                if not self._paths[key]:
                    del self._paths[key]
                self._cond.notify_all()

    def wait_for(self, path: str, timeout_s: float) -> None:
        key = os.path.abspath(path)
        with self._cond:
            if not self._cond.wait_for(lambda: key not in self._paths, timeout_s):
                raise CheckpointTimeout(
                    f"remove_checkpoint({path}): its save on another thread did not finish "
                    f"within {timeout_s} s (GdsPersistCheckpointIO(timeout_s=...)); not removed")


def _replace_other_kind(path: str, save: Callable[[str], Any]) -> Any:
    """Save at a hidden sibling, then put it where the checkpoint of the other kind (a file
    where a directory goes, or the reverse) was: a crash between the two leaves no checkpoint
    at ``path``, the new one at the hidden name."""
    parent, name = os.path.split(os.path.abspath(path))
    staged = os.path.join(parent, f".{name}.gds-new-{uuid.uuid4().hex[:12]}")
    info = save(staged)
    try:
        remove_checkpoint(path)  # refuses what is not a checkpoint
    except BaseException:
        remove_checkpoint(staged)
        raise
    os.rename(staged, path)
    fsync_path(parent)
    return info


def _remote(path: Any) -> bool:
    """A URL (``http://``, fsspec's ``s3://``, ``memory://``, ...): not a path the engine
    writes, which is a local or mounted filesystem's."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def load_from_checkpoint(cls: type, checkpoint_path: Any, map_location: Any = None,
                         hparams_file: Any = None, strict: bool | None = None,
                         weights_only: bool | None = None, *,
                         checkpoint_io: _GdsPersistCheckpointIO | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a checkpoint this plugin wrote
    (Lightning's own reads the path as a file: ``IsADirectoryError``) or a ``torch.save`` file.
    The arguments mean what they mean in Lightning.

    Parameters
    ----------
    cls
        A LightningModule or LightningDataModule class of the ``lightning`` package.
    checkpoint_path
        The checkpoint file or directory.
    map_location
        Default: where each tensor was saved, the CPU where that device is missing.
    hparams_file
        A .yaml/.yml/.csv file replacing the saved hyper-parameters.
    strict
        As the model's ``load_state_dict``.
    weights_only
        For ``torch.save`` files; a checkpoint directory never runs code.
    checkpoint_io
        The plugin to read with (its ``verify``, ``safe_globals``); default a new one.
    kwargs
        Hyper-parameters overriding the saved ones.

    Returns
    -------
    LightningModule or LightningDataModule
        The instance; a module on the device of its first saved tensor, as in Lightning.

    Raises
    ------
    TypeError
        ``cls`` is not such a class.
    ValueError
        ``hparams_file`` is not .csv, .yml or .yaml.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.core import saving

    if not (isinstance(cls, type)
            and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise TypeError(f"load_from_checkpoint: {cls!r} is not a LightningModule or "
                        "LightningDataModule class of the lightning package")
    reader = checkpoint_io or GdsPersistCheckpointIO()
    checkpoint = reader.load_checkpoint(checkpoint_path,
                                        map_location or saving._default_map_location,
                                        weights_only)
    checkpoint = saving._pl_migrate_checkpoint(checkpoint,
                                               checkpoint_path=os.fspath(checkpoint_path))
    if hparams_file is not None:
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = _hparams_from(hparams_file)
    hparams = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {}
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = {**hparams, **kwargs}
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model: Any = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    first = next((t for t in (checkpoint.get("state_dict") or {}).values()
                  if isinstance(t, torch.Tensor)), None)
    return model if first is None else model.to(first.device)


def _hparams_from(hparams_file: Any) -> Any:
    from lightning.pytorch.core import saving

    suffix = os.fspath(hparams_file).rsplit(".", 1)[-1].lower()
    if suffix == "csv":
        return saving.load_hparams_from_tags_csv(hparams_file)
    if suffix in ("yml", "yaml"):
        return saving.load_hparams_from_yaml(hparams_file)
    raise ValueError(f"hparams_file {os.fspath(hparams_file)!r}: a .csv, .yml or .yaml file is "
                     "required (as in Lightning's load_from_checkpoint)")


class GdsPersistCheckpointIO(_GdsPersistCheckpointIO, _CheckpointIO):
    """Lightning ``CheckpointIO`` writing each checkpoint through gds_persist, as a
    ``torch.save``-format file by default (for the ``lightning`` package;
    :func:`pytorch_lightning_checkpoint_io` for ``pytorch_lightning``).

    Parameters
    ----------
    format
        ``"torch"`` (default: one ``torch.save``-format file a path) or ``"directory"``.
    background
        Snapshot each checkpoint before ``save_checkpoint`` returns and write it on the
        background writer's thread (:mod:`gds_persist.training.background_writer`).
    allow_pickle
        Directory format: store leaves that are not tensors or plain data pickled.
    safe_globals
        Classes the pickle may build on load (``torch.serialization.safe_globals``).
    verify
        Check every CRC32C on load.
    timeout_s
        Bound on every wait for the background saves.
    snapshot_bytes
        The snapshot arena's size (default: one checkpoint, plus an eighth).
    save_kwargs
        :func:`gds_persist.save` keywords (:data:`STORAGE_OPTIONS`).

    Raises
    ------
    ValueError
        An unknown ``format``.
    TypeError
        An unknown save keyword, listing :data:`STORAGE_OPTIONS`.
    """

    _torch_io = _TorchCheckpointIO



def pytorch_lightning_checkpoint_io(**kwargs: Any) -> Any:
    """The plugin for a ``pytorch_lightning.Trainer`` (whose plugins derive from
    ``lightning_fabric``'s ``CheckpointIO``, another class than ``lightning``'s).

    Parameters
    ----------
    kwargs
        :class:`GdsPersistCheckpointIO`'s.

    Returns
    -------
    CheckpointIO
        A ``GdsPersistCheckpointIO`` deriving from ``lightning_fabric``'s ``CheckpointIO``.
    """
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO

    cls = type("GdsPersistCheckpointIO", (_GdsPersistCheckpointIO, CheckpointIO),
               {"_torch_io": TorchCheckpointIO, "__doc__": GdsPersistCheckpointIO.__doc__,
                "__module__": __name__})
    return cls(**kwargs)
