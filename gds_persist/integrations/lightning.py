"""PyTorch Lightning: checkpoints through gds_persist with one line (docs/INTEGRATIONS.md).

::

    from gds_persist.integrations.lightning import GdsPersistCheckpointIO

    trainer = Trainer(plugins=[GdsPersistCheckpointIO()],
                      callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss", save_last=True)])
    trainer.fit(model, ckpt_path="checkpoints/last.ckpt")   # resume

Every path Lightning names (``epoch=3-step=400.ckpt``, ``last.ckpt``) becomes a gds_persist
checkpoint *directory*: written durably and atomically (a save replaces the previous one only
once complete and fsynced), CRC32C-verified on load, never unpickled.
``remove_checkpoint`` removes the whole directory. ``load_checkpoint`` also reads a plain
``torch.save`` file (Lightning's own format), so a run started with ``TorchCheckpointIO`` resumes,
and a save over such a file (``last.ckpt``) replaces it with a directory.

``background=True``: the checkpoint is flattened and copied into a host snapshot before
``save_checkpoint`` returns, with the Checkpointer's snapshot machinery (one bounded arena, pinned
for CUDA tensors, reused from one save to the next; no second copy of the model in GPU memory):
each storage is copied once, so tied weights and views stay shared, and the manifest records the
device each storage was saved from. A background thread writes it while training goes on. The
arena holds one checkpoint by default (the next save waits for the previous write);
``snapshot_bytes`` sets its size (twice a checkpoint: a save need not wait for the previous
write). ``remove_checkpoint``, ``load_checkpoint`` and ``teardown`` wait for the writes in flight,
so a removal never races a write. Lightning's ``AsyncCheckpointIO`` wrapper also works (it clones
the tensors where they are, then calls this plugin from its thread).

Options: ``allow_pickle`` (store leaves that are not tensors / JSON / the extra leaf types pickled;
loaded only through ``torch.load(weights_only=True)``), ``safe_globals`` (classes such pickles
may hold, passed to ``torch.serialization.safe_globals`` on load), ``verify`` (check CRC32C on
load, default True), and ``gds_persist.save`` keywords (``backend``, ``io_threads``, ...).
``storage_options`` of ``Trainer.save_checkpoint`` may be a dict of those keywords too.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import CheckpointError
from ..flatten import Flattened, flatten
from ..load import load
from ..results import SaveInfo
from ..save import save
from ..transfer.commit import fsync_path
from ._common import BackgroundWriter, remove_checkpoint

try:  # the `lightning` package; `pytorch_lightning` alone ships `lightning_fabric`
    from lightning.fabric.plugins import CheckpointIO as _CheckpointIO
    from lightning.fabric.plugins import TorchCheckpointIO as _TorchCheckpointIO
except ImportError:  # pragma: no cover - exercised only without the `lightning` package
    from lightning_fabric.plugins import CheckpointIO as _CheckpointIO  # type: ignore[assignment]
    from lightning_fabric.plugins import (  # type: ignore[assignment]
        TorchCheckpointIO as _TorchCheckpointIO,
    )

__all__ = ["GdsPersistCheckpointIO", "pytorch_lightning_checkpoint_io"]
_PICKLE_HINT = "with Lightning: GdsPersistCheckpointIO(allow_pickle=True)"


class _GdsPersistCheckpointIO:
    """The plugin's behaviour, shared by the classes for ``lightning`` and ``pytorch_lightning``."""

    _torch_io: Callable[[], Any]

    def __init__(self, *, background: bool = False, allow_pickle: bool = False,
                 safe_globals: Iterable[Any] = (), verify: bool = True,
                 timeout_s: float = 1800.0, snapshot_bytes: int | None = None,
                 **save_kwargs: Any):
        self.background = background
        self.allow_pickle = allow_pickle
        self.safe_globals = list(safe_globals)
        self.verify = verify
        self.timeout_s = timeout_s
        self.save_kwargs = save_kwargs
        self._last_info: SaveInfo | None = None
        self._writer = BackgroundWriter(self._write, snapshot_bytes, timeout_s)

    @property
    def last_info(self) -> SaveInfo | None:
        """The :class:`~gds_persist.SaveInfo` of the newest completed save."""
        return self._writer.last_info if self.background else self._last_info

    # ------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        path = _local(path)
        kwargs = {**self.save_kwargs, **(storage_options or {})}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            flat = flatten(checkpoint, self.allow_pickle)  # a TypeError names the key, here
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
        """Load a gds_persist checkpoint directory (``weights_only`` changes nothing: nothing in
        it runs code), or a ``torch.save`` file through Lightning's ``TorchCheckpointIO``.
        ``map_location`` as in ``torch.load``; default: everything on the CPU, as Lightning's."""
        path = _local(path)
        self.wait()
        if os.path.isfile(path):
            return self._torch_io().load_checkpoint(  # type: ignore[no-any-return]
                path, **({} if map_location is None else {"map_location": map_location}),
                weights_only=weights_only)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        safe = (torch.serialization.safe_globals(self.safe_globals) if self.safe_globals
                else contextlib.nullcontext())
        with safe:
            state = load(path, map_location="cpu" if map_location is None else map_location,
                         verify=self.verify)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} does not hold a Lightning checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` whole (after the background saves, if any)."""
        self.wait()
        remove_checkpoint(_local(path))

    def teardown(self) -> None:
        """Finish the background saves, if any (raising the first error), stop the thread and
        free the snapshot memory."""
        self._writer.close()

    # ------------------------------------------------------------------ background

    def wait(self) -> None:
        """Block until the background saves (if any) are committed; raise the first error."""
        self._writer.wait()

    def _write(self, flat: Flattened, path: str, kwargs: dict[str, Any]) -> SaveInfo:
        if os.path.islink(path):  # ModelCheckpoint(save_last="link") left a link here
            os.unlink(path)
        if os.path.isfile(path):  # a torch.save file of an earlier run (e.g. last.ckpt)
            return _replace_file(path, lambda p: save(flat, p, **kwargs))
        return save(flat, path, **kwargs)


def _replace_file(path: str, save: Callable[[str], Any]) -> Any:
    """Save into a hidden sibling directory, then put it where the file ``path`` was (a crash
    between the two leaves no checkpoint at ``path``, the new one at the hidden name)."""
    parent, name = os.path.split(os.path.abspath(path))
    staged = os.path.join(parent, f".{name}.gds-new-{uuid.uuid4().hex[:12]}")
    info = save(staged)
    os.unlink(path)
    os.rename(staged, path)
    fsync_path(parent)
    return info


def _local(path: Any) -> str:
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(f"{text}: gds_persist checkpoints live on a local or mounted "
                         "filesystem, not at a URL")
    return text


class GdsPersistCheckpointIO(_GdsPersistCheckpointIO, _CheckpointIO):
    """Lightning ``CheckpointIO`` writing each checkpoint as a gds_persist directory (for the
    ``lightning`` package; :func:`pytorch_lightning_checkpoint_io` for ``pytorch_lightning``)."""

    _torch_io = _TorchCheckpointIO


def pytorch_lightning_checkpoint_io(**kwargs: Any) -> Any:
    """The plugin for a ``pytorch_lightning.Trainer`` (whose plugins derive from
    ``lightning_fabric``'s ``CheckpointIO``, another class than ``lightning``'s)."""
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO

    cls = type("GdsPersistCheckpointIO", (_GdsPersistCheckpointIO, CheckpointIO),
               {"_torch_io": TorchCheckpointIO, "__doc__": GdsPersistCheckpointIO.__doc__,
                "__module__": __name__})
    return cls(**kwargs)
