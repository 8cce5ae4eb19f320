"""Bad input and faults: each gets a clear error naming the thing, and nothing is lost."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gds_persist
from gds_persist import (
    BackendError,
    CheckpointError,
    ChecksumError,
    DiskFullError,
    ManifestError,
    TruncatedError,
    settings,
)
from gds_persist.backends import supports_o_direct
from gds_persist.format import MANIFEST_NAME, MAX_DEPTH
from tests.helpers import (
    BackendCase,
    assert_tree_equal,
    flip_byte,
    manifest_doc,
    random_tensor,
    rewrite_manifest,
)


def _sd() -> dict[str, Any]:
    a = torch.arange(10, dtype=torch.float32)
    return {"a": a, "b": [torch.ones(3, dtype=torch.int64)], "tied": a[2:], "step": 5}


def _siblings(path: Path) -> list[str]:
    return sorted(os.listdir(path.parent))


# --- backends -------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["save", "load", "verify", "set", "env"])
def test_unknown_backend_lists_valid_ones(tmp_path: Path, where: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gds_persist.save(_sd(), tmp_path / "ck")
    match = r"unknown backend 'nvme-magic'.*auto, direct, buffered, kvikio"
    with pytest.raises(BackendError, match=match):
        if where == "save":
            gds_persist.save(_sd(), tmp_path / "new", backend="nvme-magic")
        elif where == "load":
            gds_persist.load(tmp_path / "ck", backend="nvme-magic")
        elif where == "verify":
            gds_persist.verify(tmp_path / "ck", backend="nvme-magic")
        elif where == "set":
            settings.set(backend="nvme-magic")
        else:
            monkeypatch.setenv("GDS_PERSIST_BACKEND", "nvme-magic")
            gds_persist.save(_sd(), tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert _siblings(tmp_path / "ck") == ["ck"], "a refused save must leave nothing behind"


@pytest.fixture(params=["tmpfs", "ramfs"])
def no_o_direct_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted in-memory filesystem that refuses O_DIRECT (root only).

    tmpfs accepts O_DIRECT since Linux 6.6; then that variant is skipped and ramfs still runs.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem without O_DIRECT needs root")
    mnt = tmp_path / request.param
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", request.param, "-o", "size=8m", request.param, str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount {request.param}: {r.stderr.strip()}")
    try:
        ok, why = supports_o_direct(str(mnt))
        if ok:
            pytest.skip(f"{request.param} accepts O_DIRECT on this kernel ({os.uname().release})")
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_direct_refused_where_o_direct_is_not_supported(no_o_direct_fs: Path) -> None:
    path = no_o_direct_fs / "ck"
    with pytest.raises(BackendError, match=r"backend 'direct' cannot be used.*backend='buffered'"):
        gds_persist.save(_sd(), path, backend="direct")
    assert os.listdir(no_o_direct_fs) == [], "the refused save left files behind"
    info = gds_persist.save(_sd(), path)  # auto falls back by itself, and says why
    assert info.backend == "buffered"
    assert "O_DIRECT" in info.reason and "failed" in info.reason
    assert manifest_doc(path)["body"]["writer"]["backend"] == "buffered"
    assert_tree_equal(gds_persist.load(path), _sd())
    # probing for O_DIRECT (at save and at load) leaves no stray file anywhere
    assert sorted(os.listdir(path)) == ["data-00000.bin", MANIFEST_NAME]
    assert os.listdir(no_o_direct_fs) == ["ck"]
    with pytest.raises(BackendError, match=r"backend 'direct' cannot be used"):
        gds_persist.load(path, backend="direct")


# --- disk full ------------------------------------------------------------------------------

def test_disk_full_keeps_the_earlier_checkpoint(small_tmpfs: Path) -> None:
    path = small_tmpfs / "ck"
    old = {"w": random_tensor(torch.float32, 1 << 20, seed=1)}  # 4 MiB of an 8 MiB tmpfs
    gds_persist.save(old, path)
    new = {"w": random_tensor(torch.float32, 1 << 20, seed=2), "x": torch.ones(1)}
    match = rf"{re.escape(str(path))}: this checkpoint needs 4198400 bytes"
    with pytest.raises(DiskFullError, match=match) as ei:
        gds_persist.save(new, path)
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
    assert os.listdir(small_tmpfs) == ["ck"], "the temporary directory must be removed"
    assert_tree_equal(gds_persist.load(path), old)
    assert gds_persist.verify(path).ok


def test_disk_full_checkpoint_larger_than_the_filesystem(small_tmpfs: Path) -> None:
    path = small_tmpfs / "sub" / "ck"
    with pytest.raises(DiskFullError, match=r"needs 12582912 bytes.*free space or save elsewhere"):
        gds_persist.save({"w": torch.zeros(3 << 20)}, path)
    assert os.listdir(small_tmpfs / "sub") == []


def test_disk_full_while_writing_the_manifest(small_tmpfs: Path) -> None:
    """Data fits exactly; the manifest does not: still DiskFullError and nothing left."""
    sd = {"w": random_tensor(torch.uint8, 64 << 10, seed=3)}
    st = os.statvfs(small_tmpfs)
    filler = small_tmpfs / "filler"
    filler.write_bytes(bytes(st.f_bavail * st.f_frsize - (64 << 10)))
    with pytest.raises(DiskFullError, match=r"no space left on the filesystem of .*ck"):
        gds_persist.save(sd, small_tmpfs / "ck", backend="buffered")
    assert os.listdir(small_tmpfs) == ["filler"]
    filler.unlink()
    gds_persist.save(sd, small_tmpfs / "ck")  # and works once there is room
    assert_tree_equal(gds_persist.load(small_tmpfs / "ck"), sd)


# --- corrupted data files -------------------------------------------------------------------

def _extent_of(path: Path, storage: int) -> dict[str, Any]:
    body = manifest_doc(path)["body"]
    (e,) = [e for e in body["extents"] if e["storage"] == storage]
    return e


def test_flipped_byte_names_key_file_and_offset(backend: BackendCase, tmp_path: Path) -> None:
    path = tmp_path / "ck"
    sd = {"model": {"w1": torch.randn(3000), "w2": torch.randn(5000)}, "step": 1}
    gds_persist.save(sd, path, backend=backend.name)
    e = _extent_of(path, 1)  # model.w2
    data = path / "data-00000.bin"
    flip_byte(data, e["offset"] + 4321)
    match = (rf"checksum mismatch in tensor \['model'\]\['w2'\]: "
             rf"file {re.escape(str(data))}, offset "
             rf"{e['offset']}, 20000 bytes")
    with pytest.raises(ChecksumError, match=match):
        gds_persist.load(path, backend=backend.name)
    report = gds_persist.verify(path)
    assert not report.ok and len(report.errors) == 1
    assert "['model']['w2']" in str(report.errors[0])
    loaded = gds_persist.load(path, verify=False)  # opting out reads the damaged bytes as is
    assert torch.equal(loaded["model"]["w1"], sd["model"]["w1"])
    assert not torch.equal(loaded["model"]["w2"], sd["model"]["w2"])


@pytest.mark.parametrize("where", ["first", "last"])
def test_flipped_first_or_last_byte_of_a_tied_storage(tmp_path: Path, where: str) -> None:
    path = tmp_path / "ck"
    emb = torch.randn(7, 5)
    gds_persist.save({"wte": emb, "lm_head": emb, "other": torch.ones(2)}, path)
    e = _extent_of(path, 0)
    flip_byte(path / "data-00000.bin", e["offset"] + (0 if where == "first" else e["length"] - 1))
    with pytest.raises(ChecksumError, match=r"tensor \['wte'\] \(and 1 tensors sharing"):
        gds_persist.load(path)


def test_every_corrupted_extent_is_reported_by_verify(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=16384):
        gds_persist.save({f"t{i}": torch.full((1000,), float(i)) for i in range(4)}, path)
    for storage in (0, 3):
        flip_byte(path / "data-00000.bin", _extent_of(path, storage)["offset"] + 17)
    report = gds_persist.verify(path)
    assert sorted(str(e).split(":")[0] for e in report.errors) == [
        "checksum mismatch in tensor ['t0']", "checksum mismatch in tensor ['t3']"]


@pytest.mark.parametrize("keep", [0, 1, 4095, 4096, 8191])
def test_truncated_data_file(backend: BackendCase, tmp_path: Path, keep: int) -> None:
    path = tmp_path / "ck"
    gds_persist.save({"a": torch.randn(1000), "b": torch.randn(1000)}, path, backend=backend.name)
    data = path / "data-00000.bin"
    os.truncate(data, keep)
    match = (rf"data file {re.escape(str(data))} is {keep} bytes but the manifest records 8192: "
             r"it was truncated")
    with pytest.raises(TruncatedError, match=match):
        gds_persist.load(path, backend=backend.name)
    with pytest.raises(TruncatedError, match=match):
        gds_persist.verify(path)


def test_sizes_claimed_by_the_manifest_are_checked_before_allocating(tmp_path: Path) -> None:
    """A (resealed) manifest claiming a 16 TiB storage in a 16 TiB file is stopped by the real
    file size, not by a failed 16 TiB allocation."""
    path = tmp_path / "ck"
    gds_persist.save({"a": torch.ones(10)}, path)

    def claim_huge(body: dict[str, Any]) -> None:
        body["storages"][0]["nbytes"] = body["extents"][0]["length"] = 1 << 44
        body["files"][0]["size"] = 1 << 44

    rewrite_manifest(path, claim_huge)
    with pytest.raises(TruncatedError, match=r"is 4096 bytes but the manifest records 1759218604"):
        gds_persist.load(path)


def test_missing_data_file(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    gds_persist.save({"a": torch.randn(10)}, path)
    os.unlink(path / "data-00000.bin")
    with pytest.raises(TruncatedError, match=r"data-00000.bin is missing; the checkpoint is"):
        gds_persist.load(path)


def test_checkpoint_errors_share_one_base() -> None:
    from gds_persist import errors
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, BaseException)]
    assert len(classes) > 20
    for cls in classes:
        assert issubclass(cls, Warning) or issubclass(cls, CheckpointError), cls
        assert cls.__name__ in gds_persist.__all__, f"export {cls.__name__} from gds_persist"
    # 0.1's users caught these two as ValueError
    assert issubclass(gds_persist.ArchiveError, ValueError)
    assert issubclass(gds_persist.SafetensorsError, ValueError)


# --- corrupted and hostile manifests --------------------------------------------------------

def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    gds_persist.save(_sd(), path)
    return path


@pytest.mark.parametrize("raw, match", [
    (b"{\"format\": \"gds_persist\", \"version\": 1, \"bo", r"not valid JSON"),
    (b"\xff\xfe\x00garbage", r"not valid JSON"),
    (b"", r"not valid JSON"),
    (b"[]", r"not a gds_persist manifest"),
    (b"{\"format\": \"gds_persist\", \"version\": 1}", r"has no body"),
    (b"{\"format\": \"gds_persist\", \"version\": 1, \"body\": " + b"[" * 100_000
     + b"]" * 100_000 + b"}", r"manifest"),
    (b"{\"format\": \"gds_persist\", \"version\": 1, \"body\": {\"x\": " + b"9" * 5000 + b"}}",
     r"manifest"),
])
def test_corrupted_manifest_text(tmp_path: Path, raw: bytes, match: str) -> None:
    path = _saved(tmp_path)
    (path / MANIFEST_NAME).write_bytes(raw)
    with pytest.raises(ManifestError, match=rf"{re.escape(str(path / MANIFEST_NAME))}: .*{match}"):
        gds_persist.load(path)


def test_non_finite_number_in_manifest(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    text, n = re.subn(r'"world_size":\s*1', '"world_size": NaN', (path / MANIFEST_NAME).read_text())
    assert n == 1
    (path / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError, match=r"not valid JSON.*NaN"):
        gds_persist.load(path)


def test_edited_body_fails_the_body_checksum(tmp_path: Path) -> None:
    path = _saved(tmp_path)

    def edit(body: dict[str, Any]) -> None:
        body["tensors"][0]["shape"] = [5]

    rewrite_manifest(path, edit, reseal=False)
    with pytest.raises(ManifestError, match=r"body checksum mismatch; the manifest was corrupted"):
        gds_persist.load(path)


def _set(*keys_then_value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting ``doc[k0][k1]... = value`` for ``_set(k0, k1, ..., value)``."""
    *keys, value = keys_then_value

    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return edit


def _deep_tree(depth: int) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        node: Any = 1
        for _ in range(depth):
            node = {"t": "list", "v": [node]}
        body["tree"] = node
    return edit


# Hostile manifests with a *valid* body checksum: only the validator stands between them and
# the reader. The base checkpoint has storages [a (40 B), b (24 B)] in one 8192-byte file,
# tensors [a, b, tied=a[2:]].
HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "alignment": (_set("alignment", 512), r"unsupported alignment/checksum 512"),
    "checksum algorithm": (_set("checksum", "md5"), r"unsupported alignment/checksum"),
    "big endian": (_set("byteorder", "big"), r"only little-endian"),
    "files not a list": (_set("files", {}), r"'files' must be a list"),
    "missing field": (lambda b: b["tensors"][0].pop("requires_grad"),
                      r"tensors\[0\] must have exactly the fields"),
    "extra field": (_set("tensors", 0, "pickle", "cos\nsystem\n"),
                    r"tensors\[0\] must have exactly the fields"),
    "parent dir file": (_set("files", 0, "name", "../data-00000.bin"), r"not a plain file name"),
    "absolute file": (_set("files", 0, "name", "/etc/passwd"), r"not a plain file name"),
    "subdir file": (_set("files", 0, "name", "sub/data-00000.bin"), r"not a plain file name"),
    "dotdot file": (_set("files", 0, "name", ".."), r"not a plain file name"),
    "empty file name": (_set("files", 0, "name", ""), r"not a plain file name"),
    "nul in file name": (_set("files", 0, "name", "data\x00.bin"), r"not a plain file name"),
    "manifest as data": (_set("files", 0, "name", MANIFEST_NAME), r"not a plain file name"),
    "file size negative": (_set("files", 0, "size", -4096), r"files\[0\] size -4096"),
    "file size float": (_set("files", 0, "size", 8192.0), r"files\[0\] size 8192.0"),
    "file size unaligned": (_set("files", 0, "size", 8000), r"files\[0\] size 8000"),
    "file size overflow": (_set("files", 0, "size", 1 << 64), r"files\[0\] size"),
    "storage size negative": (_set("storages", 0, "nbytes", -40), r"storages\[0\] has a bad size"),
    "storage size overflow": (_set("storages", 0, "nbytes", 1 << 63),
                              r"storages\[0\] has a bad size"),
    "storage size bool": (_set("storages", 1, "nbytes", True), r"storages\[1\] has a bad size"),
    "extent length negative": (_set("extents", 0, "length", -1),
                               r"extents\[0\] has a negative, non-integer or overflowing field"),
    "extent offset overflow": (_set("extents", 0, "offset", 1 << 64),
                               r"extents\[0\] has a negative, non-integer or overflowing field"),
    "extent offset beyond file": (_set("extents", 1, "offset", 8192),
                                  r"extents\[1\] ends at 8216, beyond data-00000.bin \(8192 "),
    "extent far beyond file": (_set("extents", 1, "offset", 1 << 40), r"extents\[1\] ends at"),
    "extent offset unaligned": (_set("extents", 1, "offset", 4000),
                                r"offset 4000 is not 4096-aligned"),
    "extent past its storage": (_set("extents", 1, "length", 4000),
                                r"extents\[1\] ends beyond its storage's 24 bytes"),
    "extent to no storage": (_set("extents", 0, "storage", 7), r"extents\[0\] refers to a storage"),
    "extent to no file": (_set("extents", 0, "file", 1),
                          r"extents\[0\] refers to a storage or file"),
    "crc not 32-bit": (_set("extents", 0, "crc32c", 1 << 32), r"crc32c 4294967296 is not a 32-bit"),
    "gap": (lambda b: b["extents"][0].update(start=8, length=32),
            r"storage 0 has a gap or overlap at byte 0"),
    "overlap": (lambda b: b["extents"].append(dict(b["extents"][0])),
                r"storage 0 has a gap or overlap at byte 40"),
    "uncovered storage": (lambda b: b["extents"].pop(1),
                          r"storage 1 is 24 bytes but extents cover 0"),
    "short coverage": (lambda b: b["extents"][1].update(length=16),
                       r"storage 1 is 24 bytes but extents cover 16"),
    "unknown dtype": (_set("tensors", 0, "dtype", "float128"), r"tensors\[0\] is malformed"),
    "quantized dtype": (_set("tensors", 0, "dtype", "qint8"), r"tensors\[0\] is malformed"),
    "negative dim": (_set("tensors", 0, "shape", [-1]), r"tensors\[0\] is malformed"),
    "negative stride": (_set("tensors", 0, "stride", [-1]), r"tensors\[0\] is malformed"),
    "stride rank": (_set("tensors", 0, "stride", [1, 1]), r"tensors\[0\] is malformed"),
    "negative offset": (_set("tensors", 2, "storage_offset", -2), r"tensors\[2\] is malformed"),
    "tensor to no storage": (_set("tensors", 0, "storage", 2), r"tensors\[0\] is malformed"),
    "requires_grad not bool": (_set("tensors", 0, "requires_grad", 1),
                               r"tensors\[0\] is malformed"),
    "view past storage": (_set("tensors", 0, "shape", [11]),
                          r"tensors\[0\] reaches byte 44 of a 40-byte storage"),
    "offset past storage": (_set("tensors", 2, "storage_offset", 3),
                            r"tensors\[2\] reaches byte 44 of a 40-byte storage"),
    "stride past storage": (_set("tensors", 1, "stride", [2]),
                            r"tensors\[1\] reaches byte 40 of a 24-byte storage"),
    "numel overflow": (lambda b: b["tensors"][0].update(shape=[1 << 40] * 3, stride=[0, 0, 0]),
                       r"tensors\[0\]"),
    "tree tensor index": (_set("tree", "v", 0, "i", 3), r"tree node .* is not valid"),
    "tree negative index": (_set("tree", "v", 0, "i", -1), r"tree node .* is not valid"),
    "tree bad float": (_set("tree", "v", 3, {"t": "float", "v": "1e999"}), r"is not valid"),
    "tree raw list": (_set("tree", [1, 2]), r"tree holds a list"),
    "tree unknown node": (_set("tree", {"t": "pickle", "v": "x"}), r"is not valid"),
    "tree keys and values": (lambda b: b["tree"]["k"].pop(), r"is not valid"),
    "tree key type": (_set("tree", "k", 0, 1.5), r"is not valid"),
    "tree too deep": (_deep_tree(MAX_DEPTH + 1), r"tree is nested too deeply"),
    "writer not object": (_set("writer", "x"), r"'writer' must be an object"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_manifest_rejected(tmp_path: Path, case: str) -> None:
    edit, match = HOSTILE[case]
    path = _saved(tmp_path)
    rewrite_manifest(path, edit)
    manifest = re.escape(str(path / MANIFEST_NAME))
    with pytest.raises(ManifestError, match=rf"{manifest}: .*{match}"):
        gds_persist.load(path)
    with pytest.raises(ManifestError, match=match):
        gds_persist.verify(path)


@pytest.mark.parametrize("depth", [1, MAX_DEPTH])
def test_deepest_valid_tree_loads(tmp_path: Path, depth: int) -> None:
    """Any tree the validator lets through must load, not blow the interpreter's stack."""
    path = _saved(tmp_path)
    rewrite_manifest(path, _deep_tree(depth))
    got = gds_persist.load(path)
    for _ in range(depth):
        (got,) = got
    assert got == 1


def test_save_refuses_what_load_would_refuse_as_too_deep(tmp_path: Path) -> None:
    deep: Any = torch.ones(1)
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    gds_persist.save({"x": deep}, tmp_path / "ok")  # the leaf at depth MAX_DEPTH
    got = gds_persist.load(tmp_path / "ok")["x"]
    for _ in range(MAX_DEPTH - 1):
        (got,) = got
    assert torch.equal(got, torch.ones(1))
    with pytest.raises(TypeError, match=rf"nested more than {MAX_DEPTH} levels deep at \['x'\]"):
        gds_persist.save({"x": [deep]}, tmp_path / "too-deep")
    assert not (tmp_path / "too-deep").exists()


@pytest.mark.parametrize("version", [0, 99, -1, "1", None])
def test_unknown_version(tmp_path: Path, version: Any) -> None:
    path = _saved(tmp_path)
    rewrite_manifest(path, _set("version", version), whole=True)
    match = rf"format version {version!r} is not supported.*upgrade"
    with pytest.raises(ManifestError, match=match):
        gds_persist.load(path)


def test_other_format_name(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    rewrite_manifest(path, _set("format", "safetensors"), whole=True)
    with pytest.raises(ManifestError, match=r"not a gds_persist manifest"):
        gds_persist.load(path)


def test_manifest_validation_happens_before_any_data_read(tmp_path: Path) -> None:
    """A hostile manifest is rejected even when the data files it names do not exist."""
    path = _saved(tmp_path)
    rewrite_manifest(path, _set("files", 0, "name", "../../../../etc/shadow"))
    os.unlink(path / "data-00000.bin")
    with pytest.raises(ManifestError, match=r"not a plain file name"):
        gds_persist.load(path)


# --- rejected objects at save ---------------------------------------------------------------

class _MyTensor(torch.Tensor):
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantize_per_tensor is deprecated
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


REJECTED: dict[str, tuple[Callable[[], Any], str]] = {
    # (numpy arrays, bytes, namedtuples, dict subclasses: stored by value, tests/test_leaves.py)
    "object": (object, r"an object of type builtins\.object.*convert it.*allow_pickle=True"),
    "object array": (lambda: np.array([None]), r"numpy\.ndarray.*allow_pickle=True"),
    "set": (lambda: {1, 2}, r"builtins\.set.*allow_pickle=True"),
    "sparse coo": (lambda: torch.eye(3).to_sparse(), r"sparse_coo tensor.*\.to_dense\(\)"),
    "sparse csr": (lambda: torch.eye(3).to_sparse_csr(), r"sparse_csr tensor.*\.to_dense\(\)"),
    "quantized": (_quantized, r"quantized tensor \(torch\.qint8\).*int_repr\(\)"),
    "subclass": (lambda: torch.ones(2).as_subclass(_MyTensor),
                 r"tensor subclass .*_MyTensor.*as_subclass\(torch\.Tensor\)"),
    "meta tensor": (lambda: torch.empty(3, device="meta"),
                    r"device meta.*move it to 'cpu' or 'cuda'"),
    "conj bit": (lambda: torch.ones(2, dtype=torch.complex64).conj(),
                 r"lazy conj/neg.*resolve_conj"),
    "tuple key": (lambda: {(1, 2): 3}, r"dict key of type tuple.*use str or int keys"),
    "bool key": (lambda: {True: 3}, r"dict key of type bool"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_unsupported_objects_rejected_at_save(tmp_path: Path, case: str) -> None:
    make, match = REJECTED[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # beta/deprecation notes of some layouts
        bad = make()
    sd = {"model": {"layers": [torch.ones(1), bad]}, "step": 1}
    path = tmp_path / "ck"
    with pytest.raises(TypeError, match=rf"^cannot checkpoint .*{match}") as ei:
        gds_persist.save(sd, path)
    assert " at ['model']['layers'][1]" in str(ei.value)
    assert os.listdir(tmp_path) == [], "a rejected save must not create anything"


def test_rejection_names_the_key_path(tmp_path: Path) -> None:
    sd = {"optim": {"state": {3: {"exp_avg": torch.ones(1), "fn": print}}}}
    with pytest.raises(TypeError, match=r"at \['optim'\]\['state'\]\[3\]\['fn'\]: "):
        gds_persist.save(sd, tmp_path / "ck")


# --- refusing to overwrite what is not ours -------------------------------------------------

def test_saving_over_a_non_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointError, match=r"exists and is not a gds_persist checkpoint; refus"):
        gds_persist.save(_sd(), precious)
    assert os.listdir(precious) == ["thesis.tex"]
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_saving_over_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"torch.save output")
    with pytest.raises(CheckpointError, match=r"is not a gds_persist checkpoint"):
        gds_persist.save(_sd(), target)
    assert target.read_bytes() == b"torch.save output"


def test_saving_into_an_empty_directory_and_over_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    path.mkdir()
    gds_persist.save({"v": torch.zeros(2)}, path)
    gds_persist.save({"v": torch.ones(3)}, path)
    assert_tree_equal(gds_persist.load(path), {"v": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# --- settings -------------------------------------------------------------------------------

# Valid values per setting, each different from the default and from the one before it:
# (env value, set() value, argument value). A new setting must be added here.
_ALL_SETTING_VALUES: dict[str, tuple[Any, Any, Any]] = {
    "backend": ("buffered", "direct", "kvikio"),
    "block_bytes": (8192, 16384, 4096),
    "staging_bytes": (32 << 20, 48 << 20, 64 << 20),
    "io_threads": (2, 3, 5),
    "io_timeout_s": (11.5, 22.0, 33.25),
    # data-parallel settings (gds_persist.saving.data_parallel), where that code is present
    "collective_timeout_s": (12.5, 24.0, 36.75),
    "load_strategy": ("allgather", "read_all", "allgather"),
    "auto_kvikio": ("always", "never", "always"),
    "file_streams": (2, 3, 5),
    "compression": ("lossless", "auto", "lossless"),  # issue 13: gds_persist.saving.compression
    "memory_io_threads": (2, 3, 5),  # issue 25: the memory tier's writes
    "object_attempts": (2, 3, 7),  # issue 40: object-store requests
    "object_grace_s": (0.0, 60.0, 7200.0),  # issue 40: orphans of object-store saves
}
SETTING_VALUES = {k: v for k, v in _ALL_SETTING_VALUES.items() if k in settings.ENV_VARS}


def test_every_setting_has_values_under_test() -> None:
    untested = set(settings.ENV_VARS) - set(SETTING_VALUES)
    assert not untested, f"add the new setting(s) {sorted(untested)} to _ALL_SETTING_VALUES"


@pytest.mark.parametrize("name", SETTING_VALUES)
def test_setting_precedence(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env_value, set_value, arg_value = SETTING_VALUES[name]
    default = getattr(settings.Settings(), name)
    assert default not in (env_value, set_value, arg_value)
    assert getattr(settings.current(), name) == default
    monkeypatch.setenv(f"GDS_PERSIST_{name.upper()}", str(env_value))
    assert getattr(settings.current(), name) == env_value
    with settings.set(**{name: set_value}) as cfg:
        assert getattr(cfg, name) == set_value
        assert getattr(settings.current(), name) == set_value  # set() beats env
        assert getattr(settings.current(**{name: arg_value}), name) == arg_value  # arg beats set()
        assert getattr(settings.current(**{name: None}), name) == set_value  # None: not given
    assert getattr(settings.current(), name) == env_value  # restored after the block
    monkeypatch.delenv(f"GDS_PERSIST_{name.upper()}")
    assert getattr(settings.current(), name) == default
    assert getattr(settings.current(**{name: arg_value}), name) == arg_value


@pytest.mark.parametrize("name", SETTING_VALUES)
def test_setting_only_touches_its_own_field(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torchsnapshot bug: one override setting another variable."""
    defaults = settings.Settings()
    env_value, set_value, arg_value = SETTING_VALUES[name]
    others = {f: getattr(defaults, f) for f in SETTING_VALUES if f != name}
    monkeypatch.setenv(settings.ENV_VARS[name], str(env_value))
    cfgs = [settings.current()]
    with settings.set(**{name: set_value}):
        cfgs.append(settings.current())
    cfgs.append(settings.current(**{name: arg_value}))
    for cfg, want in zip(cfgs, (env_value, set_value, arg_value), strict=True):
        assert getattr(cfg, name) == want
        assert {f: getattr(cfg, f) for f in others} == others


def test_set_without_with_stays_until_restored() -> None:
    scope = settings.set(io_threads=7)
    try:
        assert settings.current().io_threads == 7
        settings.set(block_bytes=8192)  # another plain set() layers on top
        assert settings.current().io_threads == 7 and settings.current().block_bytes == 8192
    finally:
        scope.__exit__(None, None, None)
    assert settings.current().io_threads == 4 and settings.current().block_bytes == 16 << 20


def test_nested_set_restores_each_level() -> None:
    with settings.set(io_threads=2):
        with settings.set(io_threads=3, block_bytes=8192):
            assert settings.current().io_threads == 3
        assert settings.current().io_threads == 2 and settings.current().block_bytes == 16 << 20
    assert settings.current().io_threads == 4


def test_set_is_restored_after_an_exception() -> None:
    with pytest.raises(KeyError, match="boom"), settings.set(io_threads=9):
        raise KeyError("boom")
    assert settings.current().io_threads == 4


def test_settings_reach_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env, set() and argument each decide what a real save does."""
    from gds_persist.transfer import staging

    def ring_used() -> tuple[int, int, float]:
        (ring,) = staging._idle_rings
        return ring.count, ring.block_bytes, ring.timeout_s

    sd = {"w": torch.ones(10)}
    monkeypatch.setenv("GDS_PERSIST_BACKEND", "buffered")
    monkeypatch.setenv("GDS_PERSIST_BLOCK_BYTES", "8192")
    monkeypatch.setenv("GDS_PERSIST_STAGING_BYTES", "32768")
    monkeypatch.setenv("GDS_PERSIST_IO_TIMEOUT_S", "17")
    assert gds_persist.save(sd, tmp_path / "a").backend == "buffered"
    assert ring_used() == (4, 8192, 17.0)
    with settings.set(backend="direct", staging_bytes=16384, io_timeout_s=5):
        assert gds_persist.save(sd, tmp_path / "b").backend == "direct"
        assert ring_used() == (2, 8192, 5.0)
        with gds_persist.settings.set(block_bytes=4096):
            info = gds_persist.save(sd, tmp_path / "c", backend="buffered")
        assert info.backend == "buffered" and info.reason == "requested explicitly"
        assert ring_used() == (4, 4096, 5.0)
    assert gds_persist.save(sd, tmp_path / "d").backend == "buffered"


def test_io_threads_bounds_the_io_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    seen: set[str] = set()
    from gds_persist.backends import posix

    real = posix.PosixBackend.pwrite

    def spy(self: Any, handle: int, buf: Any, offset: int) -> None:
        seen.add(threading.current_thread().name)
        real(self, handle, buf, offset)

    monkeypatch.setattr(posix.PosixBackend, "pwrite", spy)
    sd = {"w": torch.ones(64 << 10)}  # 256 KiB = 32 blocks of 8 KiB
    monkeypatch.setenv("GDS_PERSIST_IO_THREADS", "1")
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=8 * 8192):
        gds_persist.save(sd, tmp_path / "a")
    assert len(seen) == 1
    seen.clear()
    with settings.set(io_threads=2):
        with gds_persist.settings.set(block_bytes=8192, staging_bytes=8 * 8192):
            gds_persist.save(sd, tmp_path / "b")
    assert 1 <= len(seen) <= 2
    seen.clear()
    with gds_persist.settings.set(block_bytes=8192, staging_bytes=8 * 8192, io_threads=3):
        gds_persist.save(sd, tmp_path / "c")
    assert 1 <= len(seen) <= 3
    assert all(n.startswith("gds_persist-io") for n in seen)


def test_unknown_setting_lists_valid_ones() -> None:
    valid = re.escape(str(sorted(settings.ENV_VARS)))
    assert "'io_threads'" in valid
    match = rf"unknown setting\(s\) \['stagin_bytes'\]; valid: {valid}"
    with pytest.raises(TypeError, match=match):
        settings.set(stagin_bytes=1 << 20)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['threads'\]"):
        settings.current(threads=2)


@pytest.mark.parametrize("values, match", [
    ({"block_bytes": 1000}, r"block_bytes=1000 .* must be a positive multiple of 4096"),
    ({"block_bytes": 0}, r"block_bytes=0 .* must be a positive multiple of 4096"),
    ({"block_bytes": -4096}, r"block_bytes=-4096 .* must be a positive multiple"),
    ({"block_bytes": "lots"}, r"block_bytes='lots' \(environment variable "
                              r"GDS_PERSIST_BLOCK_BYTES\) must be a size in bytes: an int or a "
                              r"number with a unit"),
    ({"block_bytes": 8192.5}, r"block_bytes=8192.5 .* must be a size in bytes"),
    ({"block_bytes": True}, r"block_bytes=True .* must be a size in bytes"),
    ({"staging_bytes": 16 << 20}, r"staging_bytes=16777216 .* must hold at least two blocks"),
    ({"block_bytes": 1 << 20, "staging_bytes": (1 << 20) + 4096}, r"at least two blocks"),
    ({"io_threads": 0}, r"io_threads=0 .* must be at least 1"),
    ({"io_threads": 2.5}, r"io_threads=2.5 \(environment variable GDS_PERSIST_IO_THREADS\) "
                          r"must be an int"),
    ({"memory_io_threads": 0}, r"memory_io_threads=0 .* must be at least 1"),
    ({"object_attempts": 0}, r"object_attempts=0 .* must be at least 1"),
    ({"object_grace_s": -1}, r"object_grace_s=-1.0 .* must be finite and >= 0"),
    ({"object_grace_s": float("inf")}, r"object_grace_s=inf .* must be finite"),
    ({"io_timeout_s": 0}, r"io_timeout_s=0.0 .* must be positive"),
    ({"io_timeout_s": -1}, r"io_timeout_s=-1.0 .* must be positive"),
    ({"io_timeout_s": float("nan")}, r"io_timeout_s=nan .* must be positive"),
    ({"io_timeout_s": float("inf")}, r"io_timeout_s=inf .* must be positive and finite"),
    ({"collective_timeout_s": float("nan")}, r"collective_timeout_s=nan .* must be positive"),
    ({"io_timeout_s": "soon"}, r"io_timeout_s='soon' .* must be a float"),
    ({"auto_kvikio": "sometimes"}, r"auto_kvikio='sometimes' .* must be one of gds, always, never"),
    ({"file_streams": -1}, r"file_streams=-1 .* must be 0 \(automatic\) or a number of data files"),
    pytest.param({"collective_timeout_s": 0}, r"collective_timeout_s=0.0 .* must be positive",
                 marks=pytest.mark.skipif("collective_timeout_s" not in settings.ENV_VARS,
                                          reason="no data-parallel settings in this tree")),
    pytest.param({"load_strategy": "gossip"}, r"load_strategy='gossip' .* must be one of",
                 marks=pytest.mark.skipif("load_strategy" not in settings.ENV_VARS,
                                          reason="no data-parallel settings in this tree")),
])
def test_invalid_setting_values_rejected(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        settings.set(**values)
    assert settings.current() == settings.Settings(), "a rejected set() must change nothing"
    with pytest.raises(ValueError, match=match):
        settings.current(**values)


@pytest.mark.parametrize("name, value, match", [
    ("block_bytes", "1000", r"block_bytes=1000 .* must be a positive multiple"),
    ("block_bytes", "8k", r"block_bytes='8k' \(environment variable GDS_PERSIST_BLOCK_BYTES\) "
                          r"must be a size"),
    ("io_threads", "0", r"io_threads=0 .* must be at least 1"),
    ("io_timeout_s", "never", r"io_timeout_s='never' .* must be a float"),
])
def test_invalid_environment_values_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             name: str, value: str, match: str) -> None:
    monkeypatch.setenv(settings.ENV_VARS[name], value)
    with pytest.raises(ValueError, match=match):
        gds_persist.save(_sd(), tmp_path / "ck")
    assert os.listdir(tmp_path) == []


# --- read-only checkpoints ------------------------------------------------------------------

@pytest.fixture
def read_only_checkpoint(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A checkpoint seen through a read-only bind mount (root only)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    sd = {"w": torch.randn(3000), "i": torch.arange(5)}
    gds_persist.save(sd, tmp_path / "ck")
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", str(tmp_path / "ck"), str(ro)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        yield ro, sd
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("backend", ["auto", "direct", "buffered"])
def test_load_and_verify_a_read_only_checkpoint(read_only_checkpoint: tuple[Path, Any],
                                                backend: str) -> None:
    ro, sd = read_only_checkpoint
    assert_tree_equal(gds_persist.load(ro, backend=backend), sd)
    assert gds_persist.verify(ro, backend=backend).ok
    if backend != "buffered":
        from gds_persist.backends import choose_backend

        chosen, why = choose_backend(backend, str(ro), False)
        assert chosen.name == "direct", why


# --- errors that fit the ecosystem: the OSError subclass torch.load / open would raise --------

def test_missing_checkpoint_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist"):
        gds_persist.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist"):
        gds_persist.verify(tmp_path / "nowhere")
    try:  # as torch.load users write it
        state = gds_persist.load(tmp_path / "nowhere")
    except FileNotFoundError:
        state = {"step": 0}
    assert state == {"step": 0}


def test_file_where_a_checkpoint_directory_is_expected(tmp_path: Path) -> None:
    """A file that is neither a torch.save archive nor a safetensors file (those load:
    tests/test_torch_file.py) is not a checkpoint, and nothing near it is touched."""
    target = tmp_path / "model.pt"
    target.write_bytes(b"not a checkpoint, just bytes\n" * 10)
    before = target.read_bytes()
    with pytest.raises(NotADirectoryError, match=r"model.pt is a file but neither a torch.save "
                                                 r"archive nor a safetensors file") as e:
        gds_persist.load(target)
    assert not isinstance(e.value, FileNotFoundError)  # "start fresh" must not skip over it
    assert isinstance(e.value, CheckpointError) and e.value.errno == errno.ENOTDIR
    with pytest.raises(NotADirectoryError, match=r"cannot save .*model.pt/ck: .*model.pt is a "
                                                 r"file, not a directory"):
        gds_persist.save(_sd(), target / "ck")
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]


def test_checkpointer_load_from_an_empty_root_is_a_file_not_found_error(tmp_path: Path) -> None:
    with gds_persist.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(FileNotFoundError, match=r"no committed checkpoint in .*run") as e:
            ckpt.load()
        assert isinstance(e.value, CheckpointError)  # one except for every checkpoint problem
        try:  # the resume idiom of torch.load users
            state = ckpt.load()
        except FileNotFoundError:
            state = {"step": 0}
        assert state == {"step": 0}
        ckpt.save(1, _sd()).wait()  # the root works as ever once something is there
        assert ckpt.latest_step() == 1


@pytest.mark.parametrize("where", ["root", "parent"])
def test_checkpointer_root_that_is_a_file(tmp_path: Path, where: str) -> None:
    target = tmp_path / "run.pt"
    target.write_bytes(b"a file, not a directory\n")
    root = target if where == "root" else target / "run"
    with pytest.raises(gds_persist.NotACheckpointDirectoryError,
                       match=r"Checkpointer root .*run.* cannot be a directory: .*run.pt is a "
                             r"file.*pass a directory path.*or move the file away") as e:
        gds_persist.Checkpointer(root)
    assert isinstance(e.value, NotADirectoryError) and isinstance(e.value, CheckpointError)
    assert not isinstance(e.value, FileNotFoundError)  # "start fresh" must not skip over it
    assert isinstance(e.value.__cause__, OSError)  # what the filesystem said is kept
    assert target.read_bytes() == b"a file, not a directory\n"
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]


def _as_unprivileged(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` where file permissions apply: as user nobody (``setpriv``) when this runs as
    root, which permissions do not stop."""
    drop: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and no setpriv to drop to an unprivileged user")
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([*drop, sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": repo})


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged user can reach (pytest's tmp dirs are root's, mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gds-persist-perm-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def test_permission_errors_are_permission_errors_naming_the_path(shared_dir: Path) -> None:
    gds_persist.save(_sd(), shared_dir / "private")
    (shared_dir / "private").chmod(0o700)
    (shared_dir / "ro").mkdir(mode=0o755)
    gds_persist.save(_sd(), shared_dir / "ro" / "ck")
    (shared_dir / "ro").chmod(0o555)
    code = """
import torch, gds_persist
for what, call in [("load", lambda: gds_persist.load("private")),
                   ("save", lambda: gds_persist.save({"x": torch.ones(2)}, "ro/ck"))]:
    try:
        call()
    except PermissionError as e:
        assert isinstance(e, gds_persist.CheckpointError), type(e)
        print(what, "|", e, "|", type(e.__cause__).__name__)
"""
    r = _as_unprivileged(code, shared_dir)
    assert r.returncode == 0, r.stderr
    load, save = r.stdout.splitlines()
    assert re.fullmatch(r"load \| \[Errno 13\] this process may not read the checkpoint "
                        r"private \(Permission denied\): run as its owner or make it readable "
                        r"\| PermissionError", load), load
    assert re.fullmatch(rf"save \| \[Errno 13\] cannot save {shared_dir}/ro/ck: this process "
                        rf"may not create files in {shared_dir}/ro \(Permission denied: .*\); "
                        rf"save elsewhere or make {shared_dir}/ro writable \| PermissionError",
                        save), save
    (shared_dir / "ro").chmod(0o755)
    assert_tree_equal(gds_persist.load(shared_dir / "ro" / "ck"), _sd())  # untouched
