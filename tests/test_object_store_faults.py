"""The object store's endpoint dies mid-save and mid-load (bench/s3_server.py's relay in front of
moto's server is killed with SIGKILL, cutting requests in flight, and started again on the same
port; moto keeps its objects in memory, so the store's state survives like a real store's):
a bounded failure naming the URL, the previous checkpoint intact and loaded exactly once the
endpoint is back, and what the dead save left removed by the next one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gds_persist
from bench.s3_server import S3Server
from gds_persist import settings
from gds_persist.errors import ObjectStoreError
from tests.helpers import s3_server

BUCKET = "faults"
URL = f"s3://{BUCKET}/run/step-1"
BOUND_S = 60.0  # object_attempts=2: a dead endpoint is reported within seconds


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server(BUCKET, gate=True) as server:
        yield server


def _state(value: float) -> dict[str, Any]:
    return {"big": torch.full((6 << 20,), value), "tail": torch.arange(5) * value}  # 24 MiB


class _KillOnce:
    """A progress callback that kills the endpoint once the first bytes have moved."""

    def __init__(self, s3: S3Server):
        self.s3, self.fired = s3, threading.Event()

    def __call__(self, done: int, total: int) -> None:
        if 0 < done < total and not self.fired.is_set():
            self.fired.set()
            self.s3.kill_relay()


def _keys() -> list[str]:
    import boto3

    got = boto3.client("s3").list_objects_v2(Bucket=BUCKET)
    return sorted(o["Key"] for o in got.get("Contents", []))


def _uploads() -> list[str]:
    import boto3

    return [u["Key"] for u in boto3.client("s3").list_multipart_uploads(Bucket=BUCKET)
            .get("Uploads", [])]


def test_endpoint_killed_mid_save_then_mid_load(s3: S3Server) -> None:
    before = _state(1.0)
    with settings.set(object_attempts=2, file_streams=1):
        gds_persist.save(before, URL)
        committed = gds_persist.read_manifest(URL).writer["objects"]

        # the save: parts of 8 MiB, the endpoint killed after the first one went
        kill = _KillOnce(s3)
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"s3://faults/run/step-1/\.save-.*"
                                                   r"(no answer from the endpoint|HTTP)"):
            gds_persist.save(_state(2.0), URL, progress=kill)
        assert kill.fired.is_set() and time.monotonic() - t0 < BOUND_S
        s3.start_relay()
        assert gds_persist.read_manifest(URL).writer["objects"] == committed
        got = gds_persist.load(URL)
        assert torch.equal(got["big"], before["big"]) and torch.equal(got["tail"],
                                                                      before["tail"])
        dead = [k for k in _keys() if f"/{committed}/" not in k and "/.save-" in k]

        # what the dead save left (objects it could not delete, its upload) goes with the next
        with settings.set(object_grace_s=0):
            gds_persist.save(_state(3.0), URL)
        now = gds_persist.read_manifest(URL).writer["objects"]
        assert [k for k in _keys() if "/.save-" in k and f"/{now}/" not in k] == []
        assert not set(dead) & set(_keys()) and _uploads() == []

        # the load: the endpoint killed after its first bytes, with 20 of 24 requests of 1 MiB
        # still to send (4 I/O threads)
        kill = _KillOnce(s3)
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"s3://faults/run/step-1/\.save-"), \
                settings.set(block_bytes="1MiB", staging_bytes="4MiB", io_threads=4):
            gds_persist.load(URL, progress=kill)
        assert kill.fired.is_set() and time.monotonic() - t0 < BOUND_S
        s3.start_relay()
        got = gds_persist.load(URL)
        assert torch.equal(got["big"], _state(3.0)["big"])


def test_refused_credentials_name_the_url_and_the_variables(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A server that checks credentials (moto's IAM) and does not know the key: HTTP 403."""
    with S3Server("private", auth=True) as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        with settings.set(object_attempts=2), pytest.raises(
                ObjectStoreError, match=r"s3://private/x.*HTTP 403.*refused: set "
                                        r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") as got:
            gds_persist.save(_state(1.0), "s3://private/x")
        assert got.value.status == 403
        with pytest.raises(ObjectStoreError, match=r"s3://private/x.*HTTP 403"):
            gds_persist.load("s3://private/x")
