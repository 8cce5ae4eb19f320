"""The ``s3://`` store: Amazon S3 and S3-compatible servers (MinIO, Ceph RGW), through botocore
(the client of boto3; ``docs/OBJECT_STORE.md``, "Why botocore" says why it was chosen).

Endpoint, region and credentials come from the standard AWS variables and files, as for every
AWS tool: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), ``AWS_REGION``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``~/.aws/config`` and ``~/.aws/credentials``. The client is imported on first use, never by
``import gds_persist``.

Retries are botocore's "standard" mode (exponential backoff with jitter on throttling, 5xx and
dropped connections), bounded by the ``object_attempts`` setting. The client computes no
checksums of its own: every extent's CRC32C is kept in the manifest and checked on load, end to
end, which covers what an HTTP checksum would.
"""

from __future__ import annotations

import io
import os
import time
from typing import Any

from .. import settings
from ..errors import ObjectStoreError
from .base import Listed, ObjectStore

_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
DOC = 'docs/OBJECT_STORE.md, "Endpoint and credentials"'
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                     "ExpiredToken", "InvalidToken", "AuthorizationHeaderMalformed"}


def client_key() -> tuple[str, ...]:
    """What decides the client: the AWS variables and the retry bound (a change makes a new
    client, e.g. in a test that points at another endpoint)."""
    return (*(os.environ.get(v, "") for v in _ENV), str(settings.current().object_attempts))


def open_store(bucket: str) -> S3Store:
    return S3Store(bucket)


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or \
        "the AWS default endpoint"


class S3Store(ObjectStore):
    """One bucket, through one thread-safe botocore client."""

    scheme = "s3"

    def __init__(self, bucket: str):
        import boto3  # noqa: PLC0415 - on first use only
        from botocore.config import Config  # noqa: PLC0415

        cfg = settings.current()
        self.bucket = bucket
        self.client = boto3.session.Session().client("s3", config=Config(
            retries={"max_attempts": cfg.object_attempts, "mode": "standard"},
            max_pool_connections=max(32, 4 * cfg.io_threads), connect_timeout=10,
            read_timeout=120, request_checksum_calculation="when_required",
            response_checksum_validation="when_required"))

    # errors ----------------------------------------------------------------------------------
    def _fail(self, e: Exception, key: str, doing: str) -> ObjectStoreError:
        from botocore import exceptions as bx  # noqa: PLC0415

        url = self.url(key)
        if isinstance(e, bx.NoCredentialsError):
            return ObjectStoreError(
                f"{doing} {url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or ~/.aws/credentials) ({DOC})", url)
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionClosedError,
                          bx.ConnectTimeoutError, bx.ReadTimeoutError,
                          bx.IncompleteReadError, bx.ResponseStreamingError)):
            attempts = settings.current().object_attempts
            return ObjectStoreError(
                f"{doing} {url}: no answer from the endpoint {_endpoint()} after {attempts} "
                f"attempts ({type(e).__name__}); check that the server is up, or set "
                f"AWS_ENDPOINT_URL to the right one ({DOC})", url)
        if isinstance(e, bx.ClientError):
            err, meta = e.response.get("Error", {}), e.response.get("ResponseMetadata", {})
            code, status = str(err.get("Code", "")), int(meta.get("HTTPStatusCode") or 0)
            if code == "NoSuchBucket":
                fix = (f"the bucket {self.bucket} does not exist at {_endpoint()}: create it, or "
                       "set AWS_ENDPOINT_URL to the endpoint that holds it")
            elif code in _CREDENTIAL_CODES or status == 403:
                fix = ("the credentials were refused: set AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to ones allowed to use "
                       f"{self.bucket}")
            else:
                fix = "the request failed after the bounded retries; try again later"
            return ObjectStoreError(f"{doing} {url}: HTTP {status} {code}: {fix} ({DOC})", url,
                                    status)
        return ObjectStoreError(f"{doing} {url}: {type(e).__name__}: {e} ({DOC})", url)

    def _call(self, doing: str, key: str, method: str, missing_ok: bool = False,
              **kw: Any) -> Any:
        """The client's ``method``; None for a missing object where ``missing_ok``."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kw)
        except Exception as e:  # noqa: BLE001 - every client failure, named
            if missing_ok and _missing(e):
                return None
            raise self._fail(e, key, doing) from e

    # the interface ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview) -> None:
        self._call("writing", key, "put_object", Key=key, Body=_ViewReader(memoryview(data)))

    def get(self, key: str) -> bytes | None:
        got = self._call("reading", key, "get_object", True, Key=key)
        if got is None:
            return None
        body = got["Body"]
        try:
            return bytes(body.read())
        except Exception as e:  # noqa: BLE001 - a dropped connection mid-body
            raise self._fail(e, key, "reading") from e

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """A ranged GET into ``buf``; a body cut off midway (botocore retries requests, not
        the streaming of their answers) is asked again for the rest, with backoff, bounded by
        ``object_attempts``."""
        got, attempts = 0, settings.current().object_attempts
        for attempt in range(attempts):
            n, cut = self._read_once(key, offset + got, buf[got:])
            got += n
            if cut is None:
                return got
            if attempt == attempts - 1:
                raise self._fail(cut, key, "reading") from cut
            time.sleep(min(0.1 * 2 ** attempt, 2.0))
        raise AssertionError("unreachable")

    def _read_once(self, key: str, offset: int, buf: memoryview) -> tuple[int, Exception | None]:
        """Bytes read into ``buf``, and the error that cut the body off (None: it came
        whole)."""
        if not len(buf):
            return 0, None
        rng = f"bytes={offset}-{offset + len(buf) - 1}"
        answer = self._call("reading", key, "get_object", True, Key=key, Range=rng)
        if answer is None:
            raise ObjectStoreError(f"reading {self.url(key)}: the object is gone (HTTP 404); "
                                   "it was replaced or removed meanwhile: load again",
                                   self.url(key), 404)
        body, got = answer["Body"], 0
        try:
            with body:
                while got < len(buf):
                    n = body.readinto(buf[got:])
                    if not n:
                        break
                    got += n
        except Exception as e:  # noqa: BLE001 - a dropped connection mid-body
            return got, e
        return got, None

    def size(self, key: str) -> int | None:
        head = self._call("reading", key, "head_object", True, Key=key)
        return None if head is None else int(head["ContentLength"])

    def listing(self, prefix: str) -> list[Listed]:
        out, token = [], None
        now = time.time()
        while True:
            kw: dict[str, Any] = {"Prefix": prefix,
                                  **({"ContinuationToken": token} if token else {})}
            page = self._call("listing", prefix, "list_objects_v2", **kw)
            out += [Listed(o["Key"], int(o["Size"]), now - o["LastModified"].timestamp())
                    for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return out

    def delete(self, keys: list[str]) -> None:
        for at in range(0, len(keys), 1000):  # the most one request deletes
            batch = keys[at: at + 1000]
            self._call("deleting", batch[0], "delete_objects",
                       Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})

    def start_upload(self, key: str) -> str:
        return str(self._call("writing", key, "create_multipart_upload", Key=key)["UploadId"])

    def upload_part(self, key: str, upload: str, number: int, data: memoryview) -> str:
        return str(self._call("writing", key, "upload_part", Key=key, UploadId=upload,
                              PartNumber=number, Body=_ViewReader(data))["ETag"])

    def finish_upload(self, key: str, upload: str, tags: list[tuple[int, str]]) -> None:
        parts = [{"PartNumber": n, "ETag": t} for n, t in sorted(tags)]
        self._call("writing", key, "complete_multipart_upload", Key=key, UploadId=upload,
                   MultipartUpload={"Parts": parts})

    def abort_upload(self, key: str, upload: str) -> None:
        self._call("giving up", key, "abort_multipart_upload", Key=key, UploadId=upload)

    def stale_uploads(self, prefix: str, older_than_s: float) -> list[tuple[str, str]]:
        page = self._call("listing", prefix, "list_multipart_uploads", Prefix=prefix)
        now = time.time()
        return [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])
                if now - u["Initiated"].timestamp() >= older_than_s]


class _ViewReader(io.RawIOBase):
    """A staging buffer as the file-like body of a request, read (and re-read by a retry)
    without a copy."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view.cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.view.nbytes - self.pos)
        memoryview(b).cast("B")[:n] = self.view[self.pos: self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.view.nbytes)[whence]
        self.pos = max(0, min(base + offset, self.view.nbytes))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def __len__(self) -> int:
        return self.view.nbytes


def _missing(e: Exception) -> bool:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket")
