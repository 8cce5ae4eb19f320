"""What DCP's storage writer and reader share: their ``checkpoint_id`` is the checkpoint's path."""

from __future__ import annotations

import os

from ..stores import is_url, resolve


class CheckpointPath:
    """The ``checkpoint_id`` side of a DCP storage writer / reader (list it before DCP's base
    class, so its methods stand for DCP's abstract ones): the id is the checkpoint directory's
    path, any ``os.PathLike`` or string, or an object store's URL (``s3://bucket/prefix``)."""

    path: str

    def _set_path(self, path: str | os.PathLike[str]) -> None:
        # a URL of a store (docs/OBJECT_STORE.md), never a local ./s3:/ folder; another scheme
        # is refused here
        self.path = resolve(path) if is_url(path) else os.fspath(path)

    def _reset_path(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """The part of ``reset(checkpoint_id)`` that moves to another checkpoint, if given."""
        if checkpoint_id:
            self._set_path(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return cls._accepts(os.fspath(checkpoint_id))
        except TypeError:  # not a path at all (or a bytes path the checks cannot join)
            return False

    @classmethod
    def _accepts(cls, path: str) -> bool:
        """Whether DCP may pick this storage for the checkpoint at ``path``: any path."""
        return True
