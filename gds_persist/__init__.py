"""gds_persist: fast, durable, verified checkpoints for GPU training.

    info = gds_persist.save(model_and_optimizer_state, "ckpt/step-100")
    state = gds_persist.load("ckpt/step-100", map_location="cuda")

Importing this package never imports the GPU stack (kvikio, cupy): those load only when the
``kvikio`` backend is used.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import settings  # noqa: E402
from .checkpointer import Checkpointer, SaveHandle  # noqa: E402
from .errors import (  # noqa: E402
    BackendError,
    CheckpointError,
    ChecksumError,
    CollectiveTimeoutError,
    DiskFullError,
    DistributedError,
    ManifestError,
    NotCommittedError,
    ReplicationError,
    TruncatedError,
)
from .interop import export_checkpoint, import_checkpoint  # noqa: E402
from .load import load, read_manifest, verify  # noqa: E402
from .save import SaveInfo, save  # noqa: E402

__all__ = [
    "BackendError",
    "CheckpointError",
    "Checkpointer",
    "ChecksumError",
    "CollectiveTimeoutError",
    "DiskFullError",
    "DistributedError",
    "ManifestError",
    "NotCommittedError",
    "ReplicationError",
    "SaveHandle",
    "SaveInfo",
    "TruncatedError",
    "export_checkpoint",
    "import_checkpoint",
    "load",
    "read_manifest",
    "save",
    "settings",
    "verify",
]
