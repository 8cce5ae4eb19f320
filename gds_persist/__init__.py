"""gds_persist: fast, durable, verified checkpoints for GPU training.

    info = gds_persist.save(model_and_optimizer_state, "ckpt/step-100")
    state = gds_persist.load("ckpt/step-100", map_location="cuda")

Importing this package never imports the GPU stack (kvikio, cupy): those load only when the
``kvikio`` backend is used. This module only re-exports the public API; the layers behind it are
described in CONTRIBUTING.md.
"""

from __future__ import annotations

from . import settings
from ._version import __version__
from .errors import (
    BackendError,
    CheckpointError,
    CheckpointReplacedError,
    CheckpointTimeout,
    ChecksumError,
    CollectiveTimeoutError,
    DiskFullError,
    DistributedError,
    ManifestError,
    NotCommittedError,
    PickleRefusedError,
    ReferencedCheckpointError,
    ReplicationError,
    SnapshotTooLarge,
    StateMismatchError,
    TruncatedError,
    WorkerDied,
)
from .interop import export_checkpoint, import_checkpoint
from .load import load, read_manifest, verify
from .materialize import materialize
from .results import LoadInfo, SaveInfo, WarmupReport
from .save import save
from .training.checkpointer import Checkpointer, SaveHandle
from .training.optimizer_state import init_optimizer_state
from .warmup import warmup

__all__ = [
    "BackendError",
    "CheckpointError",
    "CheckpointReplacedError",
    "CheckpointTimeout",
    "Checkpointer",
    "ChecksumError",
    "CollectiveTimeoutError",
    "DiskFullError",
    "DistributedError",
    "LoadInfo",
    "ManifestError",
    "NotCommittedError",
    "PickleRefusedError",
    "ReferencedCheckpointError",
    "ReplicationError",
    "SaveHandle",
    "SaveInfo",
    "SnapshotTooLarge",
    "StateMismatchError",
    "TruncatedError",
    "WarmupReport",
    "WorkerDied",
    "__version__",
    "export_checkpoint",
    "import_checkpoint",
    "init_optimizer_state",
    "load",
    "materialize",
    "read_manifest",
    "save",
    "settings",
    "verify",
    "warmup",
]
