"""The interface of an object store: what the commit (:mod:`.commit`), the I/O adapter
(:mod:`.io`) and the reader (:mod:`.opened`) need of one bucket. A store for another scheme
implements these methods and is named in :data:`gds_persist.stores.urls.STORES`.

Every method retries what its client calls retryable (throttling, 5xx, a dropped connection),
bounded by the ``object_attempts`` setting, then raises
:class:`~gds_persist.errors.ObjectStoreError` naming the object's URL and the HTTP status.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Listed:
    """One object of a listing."""

    key: str
    size: int
    age_s: float  # seconds since it was last modified (by the store's clock)


class ObjectStore(ABC):
    """One bucket of one store."""

    scheme: str
    bucket: str

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write the whole object ``key`` (atomic: readers see the old or the new one)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole object ``key``; None where there is none."""

    @abstractmethod
    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes of ``key`` from ``offset`` into ``buf`` (a ranged read);
        returns the bytes read (fewer at the object's end)."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The size of object ``key``; None where there is none."""

    @abstractmethod
    def listing(self, prefix: str) -> list[Listed]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are no error)."""

    @abstractmethod
    def start_upload(self, key: str) -> str:
        """Begin a multipart upload of ``key``; returns its id."""

    @abstractmethod
    def upload_part(self, key: str, upload: str, number: int, data: memoryview) -> str:
        """Upload part ``number`` (1-based; all but the last at least :attr:`min_part` bytes);
        returns its tag for :meth:`finish_upload`."""

    @abstractmethod
    def finish_upload(self, key: str, upload: str, tags: list[tuple[int, str]]) -> None:
        """Complete the upload from its ``(number, tag)`` parts: the object appears whole."""

    @abstractmethod
    def abort_upload(self, key: str, upload: str) -> None:
        """Give an unfinished upload up (its parts are freed)."""

    @abstractmethod
    def stale_uploads(self, prefix: str, older_than_s: float) -> list[tuple[str, str]]:
        """``(key, upload id)`` of unfinished uploads under ``prefix`` begun longer ago than
        ``older_than_s`` (left by killed saves)."""

    min_part: int = 5 << 20  # the smallest part but the last of a multipart upload
