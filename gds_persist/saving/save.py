"""``save``: the entry point. It checks its arguments once (:class:`.options.SaveRequest`) and
runs the save sequence (:mod:`.sequence`) with the layout of the format asked for: a checkpoint
directory (:mod:`.directory`), one torch.save file (:mod:`.torch_file`) or a Hugging Face model
directory (:mod:`.safetensors_file`)."""

from __future__ import annotations

import os
from typing import Any

from ..keywords import removed_keywords
from ..progress import ProgressCallback
from ..results import SaveInfo
from ..stores import is_url, resolve
from ..stores.io import object_settings
from .directory import DirectoryLayout
from .options import MOVED, SaveOptions, SaveRequest
from .safetensors_file import SafetensorsLayout
from .sequence import Layout, run_save
from .torch_file import TorchFileLayout


@removed_keywords(MOVED)
def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    format: str = "directory",
    backend: str | None = None,
    process_group: Any = None,
    rank_local: Any = None,
    base: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
    options: SaveOptions | None = None,
) -> SaveInfo:
    """Write ``state_dict`` to ``path`` durably and atomically; return what was written.

    An existing checkpoint at ``path`` is replaced only once the new one is complete and
    fsynced. I/O tuning (``block_bytes``, ``staging_bytes``, ``io_threads``) is set with
    :func:`gds_persist.settings.set`. Reference: ``docs/USAGE.md``, "Reference: save".

    Parameters
    ----------
    state_dict : dict
        Tensors (any device), containers and plain values; ``rank_local`` parts per rank.
    path : str or os.PathLike
        The checkpoint directory (``format="torch"``: one file); ``~`` is expanded. Or an
        object-store URL, ``s3://bucket/prefix`` (``docs/OBJECT_STORE.md``).
    format : {"directory", "torch", "safetensors"}
        A checkpoint directory, one ``torch.save`` file that stock ``torch.load`` reads, or a
        Hugging Face model directory of a flat mapping of tensors (``model.safetensors``, or
        shards beyond ``options.max_shard_size``; ``docs/USAGE.md``, "Safetensors").
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        The I/O backend (default: the ``backend`` setting, ``"auto"``).
    process_group : torch.distributed group or "default", optional
        Data-parallel: every rank calls ``save`` with its replica; each writes a byte-balanced
        share and rank 0 commits (``docs/DISTRIBUTED.md``).
    rank_local : key path or list of key paths, optional
        Subtrees that differ per rank (ZeRO shards), written by their owner only.
    base : path, optional
        An earlier checkpoint in the same parent directory: units whose bytes equal the
        base's are referred to, not written again (``docs/FORMAT.md``, version 4).
    allow_pickle : bool
        Store leaves beyond tensors and plain values pickled (single process only); ``load``
        unpickles them with ``torch.load(weights_only=True)``.
    progress : callable, optional
        ``progress(done_bytes, total_bytes)``, called as data files are written.
    options : SaveOptions, optional
        The rarer options: compression, content hashes, data-parallel layout.

    Returns
    -------
    SaveInfo
        Backend and why, bytes, seconds (:class:`~gds_persist.results.DistributedSaveInfo` with
        a process group).

    Raises
    ------
    TypeError
        An object a checkpoint cannot hold (naming its key path), or a keyword of 0.1.
    DiskFullError, BackendError, CheckpointTimeout, DistributedError
        No room; an unusable backend; another process's commit of ``path`` hangs; a rank
        failed (raised on every rank, naming it).
    """
    path = resolve(path)
    more = options if options is not None else SaveOptions()
    request = SaveRequest(
        backend=backend, progress=progress, process_group=process_group, rank_local=rank_local,
        writers_per_node=more.writers_per_node, data_dirs=more.data_dirs,
        check_replicas=more.check_replicas, allow_pickle=allow_pickle, base=base,
        compression=more.compression, content_hash=more.content_hash, format=format,
        max_shard_size=more.max_shard_size)
    if is_url(path):
        _refuse_for_objects(request, path)
    layout: Layout[Any, Any]
    if request.format == "torch":
        layout = TorchFileLayout(state_dict, path, request)
    elif request.format == "safetensors":
        layout = SafetensorsLayout(state_dict, path, request, request.max_shard_size)
    else:
        layout = DirectoryLayout(state_dict, path, request)
    return run_save(layout, path, cfg=request.cfg, process_group=request.process_group)


def _refuse_for_objects(request: SaveRequest, url: str) -> None:
    """What a save to an object store does not do (yet), refused before anything is written;
    its I/O settings raised to whole multipart parts."""
    given = [name for name, value in (
        (f"format={request.format!r}", request.format != "directory"),
        ("base", request.base is not None),
        ("compression", request.cfg.compression != "none"), ("content_hash", request.hashes),
        ("data_dirs", request.data_dirs is not None)) if value]
    if given:
        raise ValueError(f"a save to {url} cannot take {', '.join(given)}: an object-store "
                         "checkpoint is a plain directory-format checkpoint "
                         "(docs/OBJECT_STORE.md, \"Limits\"); save locally for those")
    object.__setattr__(request, "cfg", object_settings(request.cfg))
