"""PyTorch Distributed Checkpoint (DCP) storage backend.

    import torch.distributed.checkpoint as dcp
    from gds_persist.dcp import GdsPersistWriter, GdsPersistReader

    dcp.save(state_dict, storage_writer=GdsPersistWriter("ckpt/step-100"))
    dcp.async_save(state_dict, storage_writer=GdsPersistWriter("ckpt/step-200")).result()
    dcp.load(state_dict, storage_reader=GdsPersistReader("ckpt/step-200"))

DCP keeps doing the planning (deduplication, resharding on load); gds_persist does the bytes:
aligned O_DIRECT / kvikio / buffered writes, CRC32C on every extent verified on read, an atomic
commit (temporary sibling directory, fsync, rename), and byte-range balancing of large
replicated tensors across ranks. The checkpoint is a gds_persist checkpoint directory, so
``gds-persist inspect`` / ``verify`` / ``export`` work on it. See docs/INTEGRATIONS.md.

Importing this module imports ``torch.distributed.checkpoint``; ``import gds_persist`` does not.
"""

from __future__ import annotations

from ..parallel.balancing import balance, rank_bytes
from .reader import GdsPersistReader
from .writer import GdsPersistWriter

__all__ = ["GdsPersistReader", "GdsPersistWriter", "balance", "rank_bytes"]
