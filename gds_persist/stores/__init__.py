"""Where checkpoints live: local paths, or object stores keyed by URL scheme (``s3://``).

:mod:`.urls` tells them apart (and refuses schemes no store handles); :mod:`.base` is the
interface a store implements (:mod:`.s3`: S3 and S3-compatible servers); the save sequence
commits through :mod:`.commit`, the writer and reader move bytes through :mod:`.io`, and every
reader opens a checkpoint through :mod:`.opened`. No client library is imported until a URL is
used. See ``docs/OBJECT_STORE.md``.
"""

from .urls import is_url, refuse_url, resolve

__all__ = ["is_url", "refuse_url", "resolve"]
