"""Checkpoints in an object store (s3://), against a real S3-compatible server process: moto's
standalone server, started once for this module by bench/s3_server.py and talked to over HTTP
by the same client code that talks to AWS (nothing patches the client)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gds_persist
from bench.s3_server import S3Server, free_port
from gds_persist import settings
from gds_persist.cli import main as cli_main
from gds_persist.errors import (
    ChecksumError,
    NotCommittedError,
    ObjectStoreError,
    UnsupportedURLError,
)
from tests.forkserver import ForkServer
from tests.helpers import s3_server

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server(BUCKET) as server:
        yield server


@pytest.fixture
def url(s3: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh prefix per test."""
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture
def in_tmp(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test runs in an empty directory: a URL taken as a local folder would show there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _client() -> Any:
    import boto3

    return boto3.client("s3")


def _keys(prefix: str) -> list[str]:
    got = _client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


def _state(seed: int, n: int = 1000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.arange(7, dtype=torch.int64),
                      "half": torch.randn(3, 5, generator=g).half()},
            "step": seed, "name": "run"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def _no_local_folder(where: Any) -> None:
    assert sorted(os.listdir(where)) == [], f"a URL made local entries: {os.listdir(where)}"


# --- save, load, verify, inspect --------------------------------------------------------------

def test_save_load_verify_round_trip(url: str, in_tmp: Any) -> None:
    state = _state(1)
    info = gds_persist.save(state, url)
    assert info.path == url and info.backend == "s3"
    key = url.split("/", 3)[3]
    keys = _keys(key + "/")
    assert keys[-1] == f"{key}/manifest.json"
    assert all(k.startswith(f"{key}/.save-") for k in keys[:-1]) and len(keys) >= 2
    assert _equal(gds_persist.load(url), state)
    into = _state(99)
    got, linfo = gds_persist.load_with_info(url, into=into)
    assert got["model"]["w"] is into["model"]["w"] and _equal(got, state)
    assert _equal(into["model"], state["model"])
    assert linfo.backend == "s3" and "ranged reads" in linfo.reason
    report = gds_persist.verify(url)
    assert report.ok and report.extents == 3
    assert gds_persist.read_manifest(url).writer["objects"].startswith(".save-")
    _no_local_folder(in_tmp)


def test_multipart_object_of_several_parts_loads_exactly(url: str, in_tmp: Any) -> None:
    # parts of 8 MiB (block_bytes is raised to the smallest part): 3 parts, the last short
    state = {"big": torch.randn(5 << 20), "small": torch.ones(3)}  # 20 MiB + a bit
    with settings.set(block_bytes="4MiB", staging_bytes="16MiB", file_streams=1):
        info = gds_persist.save(state, url)
    assert "parts of 8 MiB" in info.reason
    assert _equal(gds_persist.load(url), state)
    _no_local_folder(in_tmp)


def test_flipped_byte_in_a_stored_object_is_caught(url: str) -> None:
    gds_persist.save(_state(2), url)
    m = gds_persist.read_manifest(url)
    key = f"{url.split('/', 3)[3]}/{m.writer['objects']}/{m.files[0].name}"
    data = bytearray(_client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    e = max(m.extents, key=lambda e: e.length)
    data[e.offset + e.length // 2] ^= 0x10
    _client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumError, match=m.files[0].name):
        gds_persist.load(url)
    report = gds_persist.verify(url)
    assert not report.ok and len(report.errors) == 1


def test_cli_inspect_and_verify_take_urls(url: str, capsys: pytest.CaptureFixture[str],
                                          in_tmp: Any) -> None:
    gds_persist.save(_state(3), url)
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {url}" in out and "['model']['w']" in out
    assert cli_main(["inspect", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["writer"]["backend"] == "s3"
    assert cli_main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(["verify", url + "-missing"]) == 2
    _no_local_folder(in_tmp)


def test_a_missing_checkpoint_is_not_committed(url: str) -> None:
    with pytest.raises(NotCommittedError, match="holds no manifest.json"):
        gds_persist.load(url)


def test_saving_again_replaces_and_removes_the_previous_objects(url: str) -> None:
    gds_persist.save(_state(4), url)
    first = gds_persist.read_manifest(url).writer["objects"]
    gds_persist.save(_state(5), url)
    second = gds_persist.read_manifest(url).writer["objects"]
    key = url.split("/", 3)[3]
    assert first != second
    assert not [k for k in _keys(key + "/") if f"/{first}/" in k]
    assert _equal(gds_persist.load(url), _state(5))


def test_orphans_of_a_killed_save_go_with_a_later_save_once_old(url: str) -> None:
    """What a save killed before its commit leaves (data objects, no manifest naming them) is
    kept while it may be a concurrent save's (younger than object_grace_s), removed after."""
    key = url.split("/", 3)[3]
    gds_persist.save(_state(6), url)
    orphan = f"{key}/.save-0000-dead/data-00000.bin"
    _client().put_object(Bucket=BUCKET, Key=orphan, Body=b"x" * 4096)
    gds_persist.save(_state(7), url)  # the default grace: it may be a live save's
    assert orphan in _keys(key + "/")
    with settings.set(object_grace_s=0):
        gds_persist.save(_state(8), url)
    assert orphan not in _keys(key + "/")
    assert _equal(gds_persist.load(url), _state(8))


def test_a_prefix_holding_other_objects_is_never_replaced(url: str) -> None:
    key = url.split("/", 3)[3]
    _client().put_object(Bucket=BUCKET, Key=f"{key}/notes.txt", Body=b"mine")
    with pytest.raises(gds_persist.CheckpointError, match="not a gds_persist checkpoint"):
        gds_persist.save(_state(9), url)
    assert _keys(key + "/") == [f"{key}/notes.txt"]


def test_what_an_object_store_save_does_not_take_is_refused_before_writing(url: str) -> None:
    key = url.split("/", 3)[3]
    for kw in ({"format": "torch"}, {"options": gds_persist.SaveOptions(data_dirs=["d"])},
               {"options": gds_persist.SaveOptions(compression="lossless")}):
        with pytest.raises(ValueError, match="OBJECT_STORE.md"):
            gds_persist.save(_state(1), url, **kw)
    assert _keys(key + "/") == []


# --- the DCP writer and reader ------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_writer_and_reader_take_urls(url: str, in_tmp: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistReader, GdsPersistWriter

    state = {"w": torch.randn(3000), "ids": torch.arange(9), "step": 4}
    dcp.save(state, storage_writer=GdsPersistWriter(url), no_dist=True)
    assert gds_persist.verify(url).ok
    back = {"w": torch.zeros(3000), "ids": torch.zeros(9, dtype=torch.int64), "step": 0}
    dcp.load(back, storage_reader=GdsPersistReader(url), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["ids"], state["ids"])
    assert back["step"] == 4
    dcp.save(state, storage_writer=GdsPersistWriter(url), no_dist=True)  # replaced whole
    key = url.split("/", 3)[3]
    assert len({k.split("/")[-2] for k in _keys(key + "/") if "/.save-" in k}) == 1
    _no_local_folder(in_tmp)


# --- URLs never become local folders ----------------------------------------------------------

ENTRIES = {
    "save": lambda u: gds_persist.save({"x": torch.ones(2)}, u),
    "load": lambda u: gds_persist.load(u),
    "load into": lambda u: gds_persist.load(u, into={"x": torch.ones(2)}),
    "verify": lambda u: gds_persist.verify(u),
    "read_manifest": lambda u: gds_persist.read_manifest(u),
    "Checkpointer": lambda u: gds_persist.Checkpointer(u).save(1, {"x": torch.ones(2)},
                                                               blocking=True),
    "MemoryTier": lambda u: gds_persist.MemoryTier(root=u),
    "export": lambda u: gds_persist.export_checkpoint("nowhere", u),
    "import": lambda u: gds_persist.import_checkpoint("nowhere.pt", u),
    "DCP writer": lambda u: __import__("gds_persist.dcp", fromlist=["x"]).GdsPersistWriter(u),
    "DCP reader": lambda u: __import__("gds_persist.dcp", fromlist=["x"]).GdsPersistReader(u),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("scheme", ["gs", "az", "S3X"])
def test_a_scheme_without_a_store_is_refused_everywhere(entry: str, scheme: str,
                                                        in_tmp: Any) -> None:
    with pytest.raises(UnsupportedURLError, match=r"s3://, file://") as got:
        ENTRIES[entry](f"{scheme}://bucket/run/step-1")
    assert f"{scheme}://bucket/run/step-1" in str(got.value)
    _no_local_folder(in_tmp)


@pytest.mark.parametrize("entry", ["export", "import", "MemoryTier"])
def test_entries_for_local_paths_refuse_s3_urls(entry: str, in_tmp: Any) -> None:
    with pytest.raises(UnsupportedURLError, match="OBJECT_STORE.md"):
        ENTRIES[entry]("s3://bucket/run/step-1")
    _no_local_folder(in_tmp)


def test_cli_refuses_unknown_schemes_without_making_folders(in_tmp: Any,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    assert cli_main(["verify", "gs://b/x"]) == 2
    assert cli_main(["inspect", "gs://b/x"]) != 0
    assert "no store handles gs://" in capsys.readouterr().err
    _no_local_folder(in_tmp)


def test_a_file_url_is_the_local_path(in_tmp: Any) -> None:
    where = in_tmp / "ck"
    gds_persist.save(_state(1), f"file://{where}")
    assert (where / "manifest.json").is_file()
    assert _equal(gds_persist.load(f"file://{where}"), _state(1))
    with pytest.raises(UnsupportedURLError, match="not local"):
        gds_persist.save(_state(1), "file://otherhost/x")


# --- the Checkpointer -------------------------------------------------------------------------

def test_checkpointer_root_in_the_store_keeps_steps_latest_and_retention(url: str) -> None:
    key = url.split("/", 3)[3]
    with gds_persist.Checkpointer(url, keep_last=2) as ck:
        for step in (10, 20, 30):
            ck.save(step, _state(step), blocking=True)
        assert ck.steps() == [20, 30]
    assert _client().get_object(Bucket=BUCKET, Key=f"{key}/latest")["Body"].read() == \
        b"step-00000030\n"
    assert not [k for k in _keys(key + "/") if "step-00000010" in k]
    with gds_persist.Checkpointer(url) as again:
        assert _equal(again.load(), _state(30)) and again.loaded_step == 30
        assert _equal(again.load(step=20), _state(20))
    assert _equal(gds_persist.load(f"{url}/step-00000020"), _state(20))
    with pytest.raises(ValueError, match="OBJECT_STORE.md"):
        gds_persist.Checkpointer(url, incremental=True)


# --- errors that name the URL and what to set -------------------------------------------------

def test_a_missing_bucket_names_the_url_and_the_endpoint_variable(s3: S3Server) -> None:
    with pytest.raises(ObjectStoreError, match=r"s3://no-such-bucket/x.*does not exist.*"
                                              r"AWS_ENDPOINT_URL") as got:
        gds_persist.save(_state(1), "s3://no-such-bucket/x")
    assert got.value.status == 404


def test_a_wrong_endpoint_fails_bounded_naming_the_url_and_variable(
        s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with settings.set(object_attempts=2), pytest.raises(
            ObjectStoreError, match=r"s3://ckpt/x.*no answer from the endpoint.*"
                                    r"AWS_ENDPOINT_URL"):
        gds_persist.load("s3://ckpt/x")


def test_missing_credentials_name_the_variables(s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Any) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ObjectStoreError, match=r"s3://ckpt/y.*AWS_ACCESS_KEY_ID"):
        gds_persist.save(_state(1), "s3://ckpt/y")


def test_import_gds_persist_does_not_import_the_client() -> None:
    """A fresh interpreter (2-3 s): this one, or a fork of it, has imported the client."""
    import subprocess

    code = "import sys, gds_persist; print(sorted(m for m in ('boto3', 'botocore') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert out.strip() == "[]"


# --- two processes saving one URL -------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, torch, gds_persist
    url, seed, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.full((300_000,), float(seed)), "seed": seed}
    for _ in range(rounds):
        gds_persist.save(state, url)
""")


def test_two_processes_saving_one_url_last_commit_wins_nothing_torn(url: str,
                                                                     tmp_path: Any) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    with ForkServer() as forks:
        workers = [forks.spawn(str(script), [url, str(seed), "6"],
                               stdout=str(tmp_path / f"out{seed}.txt")) for seed in (1, 2)]
        seen = _read_while(url, workers)
        codes = [w.wait(timeout=120) for w in workers]
    assert codes == [0, 0], [(tmp_path / f"out{s}.txt").read_text() for s in (1, 2)]
    assert seen, "no load completed while the two processes saved"
    got = gds_persist.load(url)
    seed = got["seed"]
    assert seed in (1, 2) and torch.equal(got["w"], torch.full((300_000,), float(seed)))
    assert gds_persist.verify(url).ok
    key = url.split("/", 3)[3]
    kept = gds_persist.read_manifest(url).writer["objects"]
    prefixes = {k.split("/")[-2] for k in _keys(key + "/") if "/.save-" in k}
    assert kept in prefixes  # the loser's objects of overlapping saves may stay (young: a
    # live save's for all a sweep can tell); a later save removes them once old
    with settings.set(object_grace_s=0):
        gds_persist.save(_state(3), url)
    assert {k.split("/")[-2] for k in _keys(key + "/") if "/.save-" in k} == {
        gds_persist.read_manifest(url).writer["objects"]}


def _read_while(url: str, workers: list[Any]) -> list[int]:
    """Load ``url`` until the workers exit: each load is one whole checkpoint (its checksums
    checked), or fails saying it was replaced meanwhile (its objects removed by the newer
    save): never a mix of the two."""
    seen = []
    while any(w.poll() is None for w in workers):
        try:
            got = gds_persist.load(url)
        except NotCommittedError:  # before the first commit
            continue
        except (ObjectStoreError, gds_persist.CheckpointReplacedError) as e:
            assert "gone (HTTP 404)" in str(e) or "replaced" in str(e), e
            continue
        assert torch.equal(got["w"], torch.full((300_000,), float(got["seed"])))
        seen.append(got["seed"])
    return seen
