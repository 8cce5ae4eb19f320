"""A save's options: :class:`SaveOptions` (public: the rarer knobs of :func:`gds_persist.save`)
and :class:`SaveRequest` (internal: every argument of one save as one checked, frozen record,
built once by ``save`` and passed down to the single-process or the data-parallel save)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .. import settings
from ..format.tree import KeyPath
from ..keywords import as_settings, in_options
from ..parallel.replicas import CHECK_REPLICAS
from ..progress import ProgressCallback
from ..state.rank_local import normalize_paths
from .incremental import check_base_path

FORMATS = ("directory", "torch", "safetensors")  # a checkpoint directory, one torch.save file,
# or a Hugging Face model directory
# save()'s keywords of 0.1 and their spelling since (gds_persist.keywords)
MOVED = {**as_settings("block_bytes", "staging_bytes", "io_threads"),
         **in_options("SaveOptions", "compression", "content_hash", "writers_per_node",
                      "data_dirs", "check_replicas")}


@dataclass(frozen=True)
class SaveOptions:
    """The rarer options of :func:`gds_persist.save`, passed as ``save(..., options=...)``.

    Parameters
    ----------
    compression : {"none", "lossless", "auto"}, optional
        How units are stored: raw, encoded (blosc2 bit-shuffle + LZ4) where that shrinks them,
        or encoded only where measured to make this save faster. Default: the ``compression``
        setting (``"none"``). Directory format only.
    content_hash : bool, optional
        Record BLAKE3-128 hashes so that this checkpoint can serve as a ``base`` later
        (default: True with a ``base``). Directory format only.
    writers_per_node : int, optional
        Data-parallel: the ranks that write, per node (default: every rank).
    data_dirs : list of paths, optional
        Data-parallel: stripe each node's data files over these directories (one per drive).
    check_replicas : {"structure", "checksums", "off"}
        Data-parallel: compare the replicated state across ranks by keys, dtypes and shapes,
        also by bytes, or not at all.
    max_shard_size : int or str, optional
        ``format="safetensors"``: the most tensor bytes per file before the model is cut into
        shards with an index (default ``"50GB"``, as ``save_pretrained``).
    """

    compression: str | None = None
    content_hash: bool | None = None
    writers_per_node: int | None = None
    data_dirs: Any = None
    check_replicas: str = "structure"
    max_shard_size: int | str | None = None


@dataclass(frozen=True)
class SaveRequest:
    """``save``'s arguments, its ``options`` unpacked (see :func:`gds_persist.save`), checked
    when built; ``cfg``: the settings in force for this save (``backend`` and ``compression``
    over ``settings.set`` over the environment), taken once."""

    backend: str | None = None
    progress: ProgressCallback | None = None
    process_group: Any = None
    rank_local: Any = None
    writers_per_node: int | None = None
    data_dirs: Any = None
    check_replicas: str = "structure"
    allow_pickle: bool = False
    base: str | os.PathLike[str] | None = None
    compression: str | None = None
    content_hash: bool | None = None
    format: str = "directory"
    max_shard_size: int | str | None = None
    cfg: settings.Settings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}: valid formats are {', '.join(FORMATS)}")
        if self.format in ("torch", "safetensors"):
            self._check_torch_format()
        elif self.data_parallel and self.allow_pickle:
            raise ValueError("allow_pickle=True is for single-process saves; it cannot be "
                             "combined with process_group, rank_local or data_dirs")
        object.__setattr__(self, "cfg", settings.current(  # frozen: set once, here
            backend=self.backend, compression=self.compression))
        if not self.data_parallel:  # the rest is read by data-parallel saves only
            return
        if self.check_replicas not in CHECK_REPLICAS:
            raise ValueError(f"check_replicas={self.check_replicas!r}; valid: "
                             f"{', '.join(CHECK_REPLICAS)}")
        self.rank_local_paths()  # ValueError for overlapping paths
        roots = self.roots()
        if len(set(roots)) != len(roots):
            raise ValueError(f"data_dirs lists a directory twice: {roots}")

    def _check_torch_format(self) -> None:
        """What one torch.save file cannot hold (it has no references, codec or sections)."""
        given = [name for name, value in (("base", self.base), ("compression", self.compression),
                                          ("content_hash", self.content_hash),
                                          ("rank_local", self.rank_local),
                                          ("data_dirs", self.data_dirs)) if value is not None]
        if given:
            raise ValueError(
                f"format={self.format!r} writes "
                + ("one plain torch.save file" if self.format == "torch" else
                   "plain safetensors files") + ", which cannot hold what "
                f"{', '.join(given)}= ask for (references, encoded units, per-rank parts, other "
                "directories); use the directory format (format='directory', the default) for "
                "them, or save rank-local parts as a file per rank")

    @property
    def data_parallel(self) -> bool:
        """A process group, rank-local parts or data directories: the data-parallel save."""
        return (self.process_group is not None or self.rank_local is not None
                or self.data_dirs is not None)

    @property
    def hashes(self) -> bool:
        """Whether to record content hashes (default: with a base)."""
        return self.content_hash if self.content_hash is not None else self.base is not None

    @property
    def plain(self) -> bool:
        """Raw bytes, no base, no hashes: a plain save (format version 1-3); otherwise units
        (version 4: :mod:`.units`)."""
        return self.base is None and not self.hashes and self.cfg.compression == "none"

    def base_of(self, path: str) -> str | None:
        """The base checkpoint of a save of ``path`` as an absolute path (None without one);
        ValueError unless it is a sibling of ``path``, and not ``path`` itself."""
        if self.base is None:
            return None
        return check_base_path(path, os.path.expanduser(os.fspath(self.base)))

    def rank_local_paths(self) -> list[KeyPath]:
        return normalize_paths(self.rank_local)

    def roots(self) -> list[str]:
        """The data directories, absolute."""
        return [os.path.abspath(os.path.expanduser(os.fspath(d))) for d in (self.data_dirs or [])]
