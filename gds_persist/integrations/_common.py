"""What the trainer integrations share: telling a checkpoint directory, and removing one safely.
(Their background writer, the Checkpointer's too: :mod:`gds_persist.training.background_writer`.)"""

from __future__ import annotations

import os
import shutil
import uuid

from ..errors import CheckpointError
from ..format import MANIFEST_NAME
from ..transfer.commit import fsync_path


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint at ``path``, whole: a symlink or file is unlinked; a gds_persist
    checkpoint directory is first renamed to a hidden ``.NAME.old-<hex>`` sibling (never a
    checkpoint, docs/FORMAT.md) and the rename made durable, so a crash mid-delete never leaves a
    half-deleted directory that looks committed. A directory that is not a checkpoint is refused.
    """
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
        return
    if not os.path.exists(path):
        return
    if not is_checkpoint_dir(path):
        raise CheckpointError(
            f"{path} is not a gds_persist checkpoint directory (no {MANIFEST_NAME}); refusing to "
            "delete it"
        )
    parent, name = os.path.split(os.path.abspath(path))
    hidden = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
    os.rename(path, hidden)
    fsync_path(parent)
    shutil.rmtree(hidden)
