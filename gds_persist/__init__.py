"""gds_persist: fast, durable, verified checkpoints for GPU training.

    info = gds_persist.save(model_and_optimizer_state, "ckpt/step-100")
    state = gds_persist.load("ckpt/step-100", map_location="cuda")

Importing this package never imports the GPU stack (kvikio, cupy): those load only when the
``kvikio`` backend is used. The subpackages the docs name (``gds_persist.dcp``,
``gds_persist.integrations``, ...) resolve on first use, so torch.distributed.checkpoint and the
trainer frameworks load only then. This module only re-exports the public API; the layers behind
it are described in CONTRIBUTING.md.
"""

from __future__ import annotations

from . import settings
from ._lazy import lazy_submodules
from ._version import __version__
from .convert.export import export_checkpoint
from .convert.importing import import_checkpoint
from .convert.materialize import materialize
from .errors import (
    ArchiveError,
    BackendError,
    CheckpointError,
    CheckpointPermissionError,
    CheckpointReplacedError,
    CheckpointTimeout,
    ChecksumError,
    CollectiveTimeoutError,
    DiskFullError,
    DistributedError,
    ManifestError,
    NotACheckpointDirectoryError,
    NotCommittedError,
    ObjectStoreError,
    PeerLostError,
    PickleRefusedError,
    ReferencedCheckpointError,
    ReplicationError,
    SafetensorsError,
    SnapshotTooLarge,
    StateMismatchError,
    TornCheckpointError,
    TruncatedError,
    UnhashedBaseWarning,
    UnsupportedURLError,
    WorkerDied,
)
from .loading.load import load, load_with_info, read_manifest
from .loading.options import LoadOptions
from .loading.verify import verify
from .results import LoadInfo, SaveInfo, WarmupReport
from .saving.options import SaveOptions
from .saving.save import save
from .training.checkpointer import Checkpointer, SaveHandle
from .training.optimizer_state import init_optimizer_state
from .training.options import LocalLevel, MemoryTier
from .transfer.warmup import warmup

# imported on first use (gds_persist.dcp...): they pull in torch.distributed.checkpoint, trainers
LAZY_SUBMODULES = ("advice", "cli", "dcp", "integrations")
__getattr__, __dir__ = lazy_submodules(__name__, globals(), LAZY_SUBMODULES)

__all__ = [
    "ArchiveError",
    "BackendError",
    "CheckpointError",
    "CheckpointPermissionError",
    "CheckpointReplacedError",
    "CheckpointTimeout",
    "Checkpointer",
    "ChecksumError",
    "CollectiveTimeoutError",
    "DiskFullError",
    "DistributedError",
    "LoadInfo",
    "LoadOptions",
    "LocalLevel",
    "ManifestError",
    "MemoryTier",
    "NotACheckpointDirectoryError",
    "NotCommittedError",
    "ObjectStoreError",
    "PickleRefusedError",
    "ReferencedCheckpointError",
    "PeerLostError",
    "ReplicationError",
    "SafetensorsError",
    "SaveHandle",
    "SaveInfo",
    "SaveOptions",
    "SnapshotTooLarge",
    "StateMismatchError",
    "TornCheckpointError",
    "TruncatedError",
    "UnhashedBaseWarning",
    "UnsupportedURLError",
    "WarmupReport",
    "WorkerDied",
    "__version__",
    "export_checkpoint",
    "import_checkpoint",
    "init_optimizer_state",
    "load",
    "load_with_info",
    "materialize",
    "read_manifest",
    "save",
    "settings",
    "verify",
    "warmup",
]
