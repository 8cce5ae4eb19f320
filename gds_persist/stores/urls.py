"""Which store a path names: a local path, a ``file://`` URL (the local filesystem), or a URL of
an object store (``s3://bucket/prefix``). A URL whose scheme has no store is refused with the
list of those that exist, never taken as a local folder (``save(state, "gs://b/x")`` would
otherwise make ``./gs:/b/x``).

A next store (``gs://``, ``az://``) is one module of this folder implementing
:class:`gds_persist.stores.base.ObjectStore` and one line in :data:`STORES`.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedURLError
from ..transfer.commit import URL

if TYPE_CHECKING:
    from .base import ObjectStore

# scheme -> the module of this folder whose ``open_store(bucket)`` makes its store (imported on
# first use: ``import gds_persist`` must not import a client library)
STORES: dict[str, str] = {"s3": "s3"}
LOCAL_SCHEMES = ("file",)  # file:///abs/path is the local path /abs/path (RFC 8089)
_SCHEME = URL
DOC = 'docs/OBJECT_STORE.md, "URLs"'
_stores: dict[tuple[str, str, tuple[str, ...]], ObjectStore] = {}
_lock = threading.Lock()


def scheme_of(path: Any) -> str:
    """The URL scheme of ``path`` in lower case ('' for a plain path)."""
    m = _SCHEME.match(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    return m.group(1).lower() if m else ""


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in (*sorted(STORES), *LOCAL_SCHEMES))


def is_url(path: Any) -> bool:
    """True where ``path`` names an object in a store (a scheme of :data:`STORES`); raises
    :class:`UnsupportedURLError` for a scheme no store handles."""
    scheme = scheme_of(path)
    if not scheme or scheme in LOCAL_SCHEMES:
        return False
    if scheme not in STORES:
        raise UnsupportedURLError(
            f"{os.fspath(path)}: no store handles {scheme}:// URLs; the stores are "
            f"{known_schemes()} and local paths ({DOC}); a URL is never taken as a local folder")
    return True


def resolve(path: Any, what: str = "a checkpoint path") -> str:
    """``path`` as a checkpoint location: a URL of a store (normalised: no trailing slash), or
    an absolute local path (``~`` expanded, ``file://`` stripped). Unknown schemes raise
    :class:`UnsupportedURLError`."""
    text = os.fspath(path)
    if is_url(text):
        return parse(text).url
    if scheme_of(text) in LOCAL_SCHEMES:
        text = _local_of_file_url(text)
    return os.path.abspath(os.path.expanduser(text))


def refuse_url(path: Any, entry: str) -> None:
    """For an entry point that works on local paths only: a URL of any scheme is refused."""
    if scheme_of(path) and scheme_of(path) not in LOCAL_SCHEMES:
        is_url(path)  # an unknown scheme: the list of stores
        raise UnsupportedURLError(
            f"{entry} takes local paths only, not {os.fspath(path)}; save, load, verify, "
            f"inspect, the Checkpointer and the DCP writer and reader take URLs ({DOC})")


def _local_of_file_url(text: str) -> str:
    rest = text[len("file://"):]
    host, sep, tail = rest.partition("/")
    if host not in ("", "localhost"):
        raise UnsupportedURLError(f"{text}: a file:// URL names this machine's files "
                                  f"(file:///abs/path); host {host!r} is not local ({DOC})")
    return "/" + tail if sep else "/"


@dataclass(frozen=True)
class Location:
    """A checkpoint URL split: ``scheme://bucket/key``."""

    scheme: str
    bucket: str
    key: str  # no leading or trailing slash

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else \
            f"{self.scheme}://{self.bucket}"

    def child(self, name: str) -> Location:
        return Location(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def parent(self) -> Location:
        return Location(self.scheme, self.bucket, self.key.rpartition("/")[0])

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]


def parse(url: str) -> Location:
    """``scheme://bucket/key`` -> :class:`Location` (a key is required: a checkpoint is a
    prefix inside a bucket)."""
    scheme = scheme_of(url)
    bucket, _, key = url[len(scheme) + 3:].partition("/")
    key = "/".join(p for p in key.split("/") if p)
    if not bucket or not key or any(p in (".", "..") for p in key.split("/")):
        raise UnsupportedURLError(f"{url}: a checkpoint URL is {scheme}://BUCKET/PREFIX, with a "
                                  f"prefix inside the bucket and no . or .. parts ({DOC})")
    return Location(scheme, bucket, key)


def store_for(loc: Location) -> ObjectStore:
    """The store of ``loc``'s scheme and bucket (one per bucket, endpoint and credentials: a
    change of the AWS variables makes a new client)."""
    module = importlib.import_module(f"{__package__}.{STORES[loc.scheme]}")
    key = (loc.scheme, loc.bucket, module.client_key())
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = module.open_store(loc.bucket)
    return store
