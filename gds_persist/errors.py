"""Exceptions raised by gds_persist: every one of them is defined here and exported from
``gds_persist``.

Every error names the thing that is wrong and, where there is one, the fix. All of them derive
from :class:`CheckpointError`, so a trainer can catch checkpoint problems with one ``except``
(bad input raises ``TypeError`` / ``ValueError`` instead). Those about the filesystem also derive
from the ``OSError`` subclass that ``torch.load`` / ``open`` would raise for the same path, so
code written for them keeps working: a missing checkpoint is a ``FileNotFoundError``
(:class:`NotCommittedError`), a file where a directory is expected a ``NotADirectoryError``, a
path this process may not read or write a ``PermissionError``, a full disk an ``OSError``.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error gds_persist raises on purpose."""


class ManifestError(CheckpointError):
    """The manifest is missing, malformed, from an unknown version, or describes impossible data."""


class NotCommittedError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint at the path: it does not exist, is the temporary
    directory of an interrupted save, or has no manifest. A ``FileNotFoundError``, as
    ``torch.load`` raises for a missing file (``except FileNotFoundError: start fresh``)."""


class NotACheckpointDirectoryError(CheckpointError, NotADirectoryError):
    """A path that must be a directory (a checkpoint, or a directory a checkpoint goes in) is a
    file. Not a ``FileNotFoundError``: something is there (a ``torch.save`` file, perhaps:
    ``gds_persist.import_checkpoint`` converts one)."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """This process may not read the checkpoint, or may not create files where a save goes;
    the message names the path (the ``OSError`` from the filesystem is its ``__cause__``)."""


class ChecksumError(CheckpointError):
    """Bytes read back do not match the CRC32C recorded when they were written."""


class TruncatedError(CheckpointError):
    """A data file is shorter than the manifest says, or missing."""


class CheckpointReplacedError(CheckpointError):
    """The checkpoint at the path was replaced (or removed) by another process while this one
    was opening it, more often in a row than a load retries by itself: load it again. Never
    raised once a load holds all the files it reads (``docs/FORMAT.md``, "Several processes,
    one path")."""


class ReferencedCheckpointError(CheckpointError):
    """An incremental checkpoint refers to bytes held by a sibling checkpoint (its base) that is
    missing, was moved, or was replaced since: nothing wrong is read; restore the base, or load
    a standalone checkpoint (``gds-persist materialize`` makes one while the base exists)."""


class ArchiveError(CheckpointError, ValueError):
    """Bytes that are not a ``torch.save`` archive gds_persist can lay out or read in place (the
    message says why). A ``ValueError`` too, as in 0.1."""


class SafetensorsError(CheckpointError, ValueError):
    """Bytes that are not a well-formed safetensors file (the message says why). A
    ``ValueError`` too, as in 0.1."""


class BackendError(CheckpointError):
    """The requested I/O backend cannot be used here (unknown name, no O_DIRECT, no GPU stack)."""


class DiskFullError(CheckpointError, OSError):
    """The target filesystem has no room for the checkpoint; nothing earlier was touched."""


class DistributedError(CheckpointError):
    """A data-parallel save or load failed on some rank; every rank raises it, naming the failed
    rank(s) and cause(s) in the message and in ``failed_ranks`` (rank -> cause)."""

    def __init__(self, message: str, *, failed_ranks: dict[int, str] | None = None,
                 phase: str | None = None):
        super().__init__(message)
        self.failed_ranks = dict(failed_ranks or {})
        self.phase = phase


class CollectiveTimeoutError(DistributedError):
    """A rank waited longer than ``collective_timeout_s`` for the others (one hung or died)."""


class PeerLostError(DistributedError):
    """A point-to-point copy (the memory tier's replicas) lost its peer: the peer rank died, or
    sent or took nothing for ``peer_timeout_s``. ``peer`` is its rank (also in the message)."""

    def __init__(self, message: str, *, peer: int, phase: str | None = None):
        super().__init__(message, failed_ranks={peer: message}, phase=phase)
        self.peer = peer


class ReplicationError(DistributedError):
    """State promised to be replicated differs between ranks (structure, sizes or checksums)."""


class TornCheckpointError(CheckpointError):
    """A tensor's bytes changed between ``save()`` and the moment they were written (a forward
    pass, another optimizer, user code): the checkpoint would mix two states, so it is refused
    and not committed; earlier checkpoints are intact. ``tensors`` names them."""

    def __init__(self, message: str, tensors: list[str] | None = None):
        super().__init__(message)
        self.tensors = list(tensors or [])


class CheckpointTimeout(CheckpointError, TimeoutError):
    """A bounded wait on background checkpoint work (a :class:`gds_persist.Checkpointer`) ran
    out: the write is still running (slow or hung storage); or a save waited ``io_timeout_s``
    for another live process to finish committing the same path."""


class WorkerDied(CheckpointError):
    """A Checkpointer thread, or its helper process, stopped in the middle of a save; that save
    is lost and a new worker takes the next one."""


class SnapshotTooLarge(CheckpointError):
    """A state dict is larger than the whole snapshot arena (``snapshot_bytes``)."""


class PickleRefusedError(CheckpointError):
    """A leaf saved with ``allow_pickle=True`` needs a class that ``torch.load(weights_only=True)``
    does not allow; the message names the key path and how to allow it."""


class StateMismatchError(CheckpointError, ValueError):
    """``load(into=state)``: the tensors of ``state`` do not fit the checkpoint (shapes, dtypes,
    missing or unexpected keys with ``strict=True``, destinations tied where the checkpoint's
    tensors are not); raised before any byte is read, every mismatch in one message."""


class ObjectStoreError(CheckpointError):
    """A request to an object store failed for good (after the bounded retries): names the URL
    of the object, the HTTP status (``status``, 0 when no answer came) and, for a missing bucket,
    an unreachable endpoint or refused credentials, the environment variable to set."""

    def __init__(self, message: str, url: str = "", status: int = 0):
        super().__init__(message)
        self.url, self.status = url, status


class UnsupportedURLError(CheckpointError, ValueError):
    """A path with a URL scheme that no store handles (``gs://`` before a store for it exists),
    or an entry point that does not take URLs: refused, never taken as a local folder; the
    message lists the schemes that have a store."""


class UnhashedBaseWarning(UserWarning):
    """``save(..., base=...)`` (or a Checkpointer resuming from a plain step) got a base whose
    bytes carry no content hash, so nothing of them could be referred to and they were written
    again. Save the base with ``content_hash=True`` (``Checkpointer(incremental=True)`` does);
    the same words are in ``SaveInfo.reason``."""
