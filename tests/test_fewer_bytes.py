"""Writing fewer bytes (format version 4): incremental checkpoints (``base=``, content hashes,
references) and lossless compression, exact on load.

Covers: exactness of encoded extents for every dtype and for NaN / inf / denormal payloads; a
changed single byte is never deduplicated; chains are flattened; references survive retention;
corrupted encoded or referenced extents raise ChecksumError naming the tensor; a missing, moved or
replaced base is a clear error; references outside the checkpoint's root are refused; materialize
and export make standalone copies; ``auto`` never compresses on tmpfs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_tree_equal, flip_byte, random_tensor, rewrite_manifest

import gds_persist
from gds_persist.format import base_names, codec, parse_manifest
from gds_persist.format.hashing import EMPTY, content_hash
from gds_persist.training import steps as _steps

SHM = "/dev/shm"
MIB = 1 << 20


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _specials_fp32(n: int, seed: int = 0) -> torch.Tensor:
    """Trained-looking fp32 values salted with NaN payloads, +-inf, +-0, denormals."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 0.02
    bits = t.view(torch.int32)
    specials = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345 - (1 << 32), 0x7F800000,
                             0xFF800000 - (1 << 32), 0x00000000, 0x80000000 - (1 << 32),
                             0x00000001, 0x007FFFFF, 0x80000001 - (1 << 32), 0x7F7FFFFF],
                            dtype=torch.int32)
    idx = torch.randint(0, n, (n // 50,), generator=g)
    bits[idx] = specials[torch.arange(idx.numel()) % specials.numel()]
    return bits.view(torch.float32)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "frozen": (torch.randn(300_000, generator=g) * 0.02).to(torch.bfloat16),
        "trained": _specials_fp32(100_000, seed),
        "exp_avg_sq": torch.rand(100_000, generator=g) * 1e-6,
        "step": torch.tensor(7.0),
        "count": 3,
        "empty": torch.empty(0),
    }


def _saved_bytes_equal(got: dict, want: dict) -> None:
    assert_tree_equal(got, want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert _bits(got[k]) == _bits(v), k


# --- content hash ---------------------------------------------------------------------------

def test_content_hash_is_blake3_128():
    blake3 = pytest.importorskip("blake3")
    for data in (b"", b"a", bytes(range(256)) * 41):
        assert content_hash(data) == blake3.blake3(data).digest()[:16].hex()
    assert content_hash(b"") == EMPTY


# --- compression ----------------------------------------------------------------------------

def test_plain_save_stays_version_1(tmp_path):
    gds_persist.save(_state(), tmp_path / "c")
    assert gds_persist.read_manifest(tmp_path / "c").version == 1


EVERY_DTYPE = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
               torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
               torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def test_lossless_is_exact_for_every_dtype_and_special_values(tmp_path):
    state = {str(d).removeprefix("torch."): random_tensor(d, (256 << 10) // d.itemsize, seed=i)
             for i, d in enumerate(EVERY_DTYPE)}
    # compressible payloads too, so that most extents really are encoded
    state["zeros_f32"] = torch.zeros(100_000)
    state["specials"] = _specials_fp32(200_000)
    state["denormals"] = (torch.arange(1, 100_001, dtype=torch.int32)).view(torch.float32)
    state["nan_payloads"] = (torch.arange(100_000, dtype=torch.int32) | 0x7F800001).view(
        torch.float32)
    state["bf16"] = (torch.randn(200_000) * 0.02).to(torch.bfloat16)
    state["odd"] = torch.arange(70_001, dtype=torch.uint8)  # length not a type-size multiple
    state["view"] = state["bf16"][3:99_000:2]
    info = gds_persist.save(state, tmp_path / "c",
                            options=gds_persist.SaveOptions(compression="lossless"))
    assert info.compression == "lossless" and "lossless" in info.compression_reason
    m = gds_persist.read_manifest(tmp_path / "c")
    assert m.version == 4
    encoded = [e for e in m.extents if e.encoded]
    assert len(encoded) >= 6  # the compressible ones
    assert all(e.offset % 4096 == 0 for e in m.extents)
    assert info.bytes_written < sum(align(s.nbytes) for s in m.storages)
    got = gds_persist.load(tmp_path / "c")
    _saved_bytes_equal(got, state)
    assert got["view"].untyped_storage().data_ptr() == got["bf16"].untyped_storage().data_ptr()
    report = gds_persist.verify(tmp_path / "c")
    assert report.ok and report.encoded_extents == len(encoded)


def align(n: int) -> int:
    return -(-n // 4096) * 4096


def test_compressed_file_layout_is_aligned_and_trimmed(tmp_path):
    gds_persist.save({"z": torch.zeros(1 << 20)}, tmp_path / "c",
                     options=gds_persist.SaveOptions(compression="lossless"))
    m = gds_persist.read_manifest(tmp_path / "c")
    (e,) = m.extents
    assert e.encoded and e.stored < e.length // 50
    (f,) = m.files
    assert f.size == align(e.stored) == os.path.getsize(tmp_path / "c" / f.name)


def test_corrupted_encoded_extent_names_the_tensor(tmp_path):
    state = _state()
    gds_persist.save(state, tmp_path / "c", options=gds_persist.SaveOptions(compression="lossless"))
    m = gds_persist.read_manifest(tmp_path / "c")
    e = next(e for e in m.extents if e.length == state["frozen"].numel() * 2)
    assert e.encoded
    name = "frozen"
    flip_byte(tmp_path / "c" / m.files[e.file].name, e.offset + e.stored // 2)
    with pytest.raises(gds_persist.ChecksumError, match=rf"\['{name}'\].*stored"):
        gds_persist.load(tmp_path / "c")
    report = gds_persist.verify(tmp_path / "c")
    assert not report.ok and name in str(report.errors[0])


def test_auto_never_compresses_on_tmpfs(tmp_path):
    if not os.path.isdir(SHM):
        pytest.skip(f"{SHM} (tmpfs) is not mounted here")
    d = Path(SHM) / f"gdsp-test-{os.getpid()}"
    d.mkdir()
    try:
        info = gds_persist.save(_state(), d / "c",
                                options=gds_persist.SaveOptions(compression="auto"))
    finally:
        shutil.rmtree(d)
    assert info.compression == "none", info.compression_reason
    assert "compression='auto': not compressing" in info.compression_reason
    assert "memory-backed filesystem (tmpfs)" in info.compression_reason


def test_auto_says_why_either_way(tmp_path):
    info = gds_persist.save(_state(), tmp_path / "c",
                            options=gds_persist.SaveOptions(compression="auto"))
    assert info.compression_reason.startswith("compression='auto': ")
    assert "GB/s" in info.compression_reason  # the measured figures behind the choice
    got = gds_persist.load(tmp_path / "c")
    _saved_bytes_equal(got, _state())


def test_auto_rule():
    from gds_persist.saving.compression import AUTO_GAIN, predicted_gain

    assert predicted_gain(rate=3e9, ratio=1.3, drive=2e9) == pytest.approx(1.3)  # drive-bound
    assert predicted_gain(rate=2.2e9, ratio=1.3, drive=2e9) == pytest.approx(1.1)  # CPU-bound
    assert predicted_gain(rate=2e9, ratio=1.3, drive=5e9) < 1 < AUTO_GAIN  # tmpfs: never pays


def test_compression_setting_and_validation(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        gds_persist.save(_state(), tmp_path / "c",
                         options=gds_persist.SaveOptions(compression="zstd"))
    with gds_persist.settings.set(compression="lossless"):
        info = gds_persist.save(_state(), tmp_path / "c")
    assert info.compression == "lossless"


# --- incremental ----------------------------------------------------------------------------

def test_incremental_refers_to_unchanged_bytes_and_loads_exactly(tmp_path):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    b = dict(a, trained=a["trained"] + 1, count=4)
    info = gds_persist.save(b, tmp_path / "s2", base=tmp_path / "s1")
    frozen_bytes = a["frozen"].numel() * 2 + a["exp_avg_sq"].numel() * 4 + 4
    assert info.referenced_bytes == frozen_bytes
    assert info.bytes_written == align(b["trained"].numel() * 4)
    m = gds_persist.read_manifest(tmp_path / "s2")
    assert m.version == 4 and [x.name for x in m.bases] == ["s1"]
    _saved_bytes_equal(gds_persist.load(tmp_path / "s2"), b)
    report = gds_persist.verify(tmp_path / "s2")
    assert report.ok and report.referenced_bytes == frozen_bytes


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_changed_single_byte_is_never_deduplicated(tmp_path, monkeypatch, where):
    monkeypatch.setattr(codec, "UNIT_BYTES", 64 << 10)  # several units per tensor, fast
    a = {"w": random_tensor(torch.float32, 100_000), "x": random_tensor(torch.uint8, 5000, 1)}
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    b = {k: v.clone() for k, v in a.items()}
    n = b["w"].numel() * 4
    pos = {"first": 0, "middle": n // 2 + 1, "last": n - 1}[where]
    b["w"].view(torch.uint8)[pos] ^= 1
    info = gds_persist.save(b, tmp_path / "s2", base=tmp_path / "s1")
    got = gds_persist.load(tmp_path / "s2")
    _saved_bytes_equal(got, b)
    unit = 64 << 10
    assert info.referenced_bytes == n - min(unit, n - pos // unit * unit) + 5000


@pytest.mark.parametrize("threads", [1, 3])
def test_hashing_ahead_gives_every_unit_its_own_hash_and_stops(tmp_path, monkeypatch, threads):
    """Units hashed from the back of the queue by the hash-ahead threads carry the hash of their
    own bytes (a wrong one would refer a changed unit to the base), and no such thread outlives
    the save."""
    import threading
    import time

    from gds_persist.stages import profiling
    from gds_persist.transfer import unit_writer

    monkeypatch.setattr(codec, "UNIT_BYTES", 64 << 10)
    monkeypatch.setattr(unit_writer, "HASH_AHEAD_THREADS", threads)
    a = {f"w{i}": random_tensor(torch.float32, 50_000, i) for i in range(8)}
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    b = {k: v.clone() for k, v in a.items()}
    for k in ("w0", "w7"):
        b[k].view(torch.uint8)[12345] ^= 0x40  # one unit of the first and of the last tensor
    ahead_hashed = threading.Event()
    real_hash = unit_writer.content_hash
    deadline = time.monotonic() + 10

    def gated(data):  # the I/O threads wait (10 s in all) until a hash-ahead thread hashed one
        if threading.current_thread().name == "gds_persist-hash-ahead":
            h = real_hash(data)
            ahead_hashed.set()
            return h
        ahead_hashed.wait(max(0.0, deadline - time.monotonic()))
        return real_hash(data)

    monkeypatch.setattr(unit_writer, "content_hash", gated)
    with profiling() as prof:
        info = gds_persist.save(b, tmp_path / "s2", base=tmp_path / "s1")
    assert ahead_hashed.is_set() and prof.stages["hash (ahead)"].nbytes > 0
    assert not [t for t in threading.enumerate() if t.name == "gds_persist-hash-ahead"]
    assert info.bytes_written == 2 * (64 << 10)
    m = gds_persist.read_manifest(tmp_path / "s2")
    keys = {s: k for k, s in ((k, i) for i, k in enumerate(b))}
    for e in m.extents:
        flat = b[keys[e.storage]].view(torch.uint8).reshape(-1)
        assert e.blake3 == content_hash(flat[e.start : e.start + e.length].numpy()), e
    _saved_bytes_equal(gds_persist.load(tmp_path / "s2"), b)


def test_chains_are_flattened_and_base_identity_is_checked(tmp_path):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    b = dict(a, trained=a["trained"] * 2)
    gds_persist.save(b, tmp_path / "s2", base=tmp_path / "s1")
    c = dict(b, exp_avg_sq=b["exp_avg_sq"] + 1)
    gds_persist.save(c, tmp_path / "s3", base=tmp_path / "s2")
    m = gds_persist.read_manifest(tmp_path / "s3")
    by_base = {m.bases[m.files[e.file].base - 1].name for e in m.extents if m.files[e.file].base}
    assert by_base == {"s1", "s2"}  # frozen bytes refer straight to s1, where they are
    _saved_bytes_equal(gds_persist.load(tmp_path / "s3"), c)
    # s1 replaced by another save: s3's references to it must not read the new bytes
    gds_persist.save(_state(seed=5), tmp_path / "s1")
    with pytest.raises(gds_persist.ReferencedCheckpointError, match="s1.*replaced"):
        gds_persist.load(tmp_path / "s3")


def test_missing_or_moved_base_is_a_clear_error(tmp_path):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    gds_persist.save(dict(a, count=9), tmp_path / "s2", base=tmp_path / "s1")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(tmp_path / "s2", moved / "s2")  # moved away from its base
    with pytest.raises(gds_persist.ReferencedCheckpointError, match="s1.*missing"):
        gds_persist.load(moved / "s2")
    shutil.move(moved / "s2", tmp_path / "s2")
    _saved_bytes_equal(gds_persist.load(tmp_path / "s2"), dict(a, count=9))
    shutil.rmtree(tmp_path / "s1")
    with pytest.raises(gds_persist.ReferencedCheckpointError, match="missing"):
        gds_persist.load(tmp_path / "s2")
    with pytest.raises(gds_persist.ReferencedCheckpointError):
        gds_persist.verify(tmp_path / "s2")


def test_base_must_be_a_sibling_and_not_the_path(tmp_path):
    gds_persist.save(_state(), tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="sibling"):
        gds_persist.save(_state(), tmp_path / "sub" / "s2", base=tmp_path / "s1")
    with pytest.raises(ValueError, match="being saved"):
        gds_persist.save(_state(), tmp_path / "s1", base=tmp_path / "s1")


@pytest.mark.parametrize("name", ["../s1", "/abs", ".hidden", "a/b", "..", ".s1.tmp-abc"])
def test_validator_refuses_references_outside_the_root(tmp_path, name):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    gds_persist.save(dict(a, count=1), tmp_path / "s2", base=tmp_path / "s1")

    def edit(body):
        body["bases"][0]["name"] = name

    rewrite_manifest(tmp_path / "s2", edit)
    with pytest.raises(gds_persist.ManifestError, match="sibling|plain name"):
        gds_persist.read_manifest(tmp_path / "s2")


def test_a_symlinked_base_leaving_the_root_is_refused(tmp_path):
    a = _state()
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    gds_persist.save(a, root / "s1", options=gds_persist.SaveOptions(content_hash=True))
    gds_persist.save(dict(a, count=1), root / "s2", base=root / "s1")
    shutil.move(root / "s1", outside / "s1")  # the base now lives elsewhere, behind a link
    os.symlink(outside / "s1", root / "s1")
    with pytest.raises(gds_persist.ManifestError, match="outside the checkpoint's root"):
        gds_persist.load(root / "s2")
    with pytest.raises(ValueError, match="sibling"):  # and a save does not refer through one
        gds_persist.save(a, root / "s3", base=root / "s1")


def test_older_readers_are_told_to_upgrade(tmp_path):
    gds_persist.save(_state(), tmp_path / "c",
                     options=gds_persist.SaveOptions(compression="lossless"))
    rewrite_manifest(tmp_path / "c", lambda doc: doc.update(version=5), whole=True)
    with pytest.raises(gds_persist.ManifestError, match="upgrade gds_persist"):
        gds_persist.read_manifest(tmp_path / "c")


@pytest.mark.parametrize("edit, match", [
    (lambda b: b["extents"][0].update(codec="zstd"), "codec"),
    (lambda b: b["extents"][0].update(blake3="xyz"), "blake3"),
    (lambda b: b["files"][-1].update(base=7), "base"),
    (lambda b: b["bases"][0].update(manifest_sha256="00"), "manifest_sha256"),
    (lambda b: next(e for e in b["extents"] if e["codec"] == "none").update(stored=1),
     "stored raw"),
])
def test_validator_checks_the_version_4_fields(tmp_path, edit, match):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    gds_persist.save(dict(a, trained=a["trained"] + 1), tmp_path / "s2", base=tmp_path / "s1",
                     options=gds_persist.SaveOptions(compression="lossless"))
    rewrite_manifest(tmp_path / "s2", edit)
    with pytest.raises(gds_persist.ManifestError, match=match):
        gds_persist.read_manifest(tmp_path / "s2")


def test_corrupted_referenced_extent_names_the_tensor(tmp_path):
    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    gds_persist.save(dict(a, trained=a["trained"] + 1), tmp_path / "s2", base=tmp_path / "s1")
    m1 = gds_persist.read_manifest(tmp_path / "s1")
    frozen = next(e for e in m1.extents if e.length == a["frozen"].numel() * 2)
    flip_byte(tmp_path / "s1" / m1.files[frozen.file].name, frozen.offset + 10)
    with pytest.raises(gds_persist.ChecksumError, match=r"\['frozen'\]"):
        gds_persist.load(tmp_path / "s2")
    report = gds_persist.verify(tmp_path / "s2")
    assert len(report.errors) == 1 and "['frozen']" in str(report.errors[0])


def test_materialize_and_export_make_standalone_copies(tmp_path, capsys):
    from gds_persist.cli import main

    a = _state()
    gds_persist.save(a, tmp_path / "s1", options=gds_persist.SaveOptions(content_hash=True))
    b = dict(a, trained=a["trained"] + 1)
    gds_persist.save(b, tmp_path / "s2", base=tmp_path / "s1",
                     options=gds_persist.SaveOptions(compression="lossless"))
    assert main(["inspect", str(tmp_path / "s2")]) == 0
    out = capsys.readouterr().out
    assert "referenced in base checkpoints" in out and "[referenced: s1]" in out
    assert main(["materialize", str(tmp_path / "s2"), str(tmp_path / "standalone")]) == 0
    assert main(["export", str(tmp_path / "s2"), "--to", "torch",
                 str(tmp_path / "s2.pt")]) == 0
    shutil.rmtree(tmp_path / "s1")
    m = gds_persist.read_manifest(tmp_path / "standalone")
    assert not m.bases and m.referenced_bytes == 0
    _saved_bytes_equal(gds_persist.load(tmp_path / "standalone"), b)
    assert gds_persist.verify(tmp_path / "standalone").ok
    exported = torch.load(tmp_path / "s2.pt", weights_only=True)
    for k in ("frozen", "trained"):
        assert _bits(exported[k]) == _bits(b[k])


# --- Checkpointer ---------------------------------------------------------------------------

def _train_steps(ckpt, n, frozen, start=1):
    states = {}
    trained = torch.zeros(50_000)
    for step in range(start, start + n):
        trained = trained + step
        state = {"frozen": frozen, "trained": trained.clone(), "step": step}
        ckpt.save(step, state, blocking=True)
        states[step] = state
    return states


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_checkpointer_incremental_keeps_what_kept_steps_refer_to(tmp_path, mode):
    frozen = (torch.randn(400_000) * 0.02).to(torch.bfloat16)
    with gds_persist.Checkpointer(tmp_path, keep_last=2, mode=mode, incremental=True,
                                  compression="lossless") as ckpt:
        states = _train_steps(ckpt, 4, frozen)
        stats = ckpt.stats
    # steps 3 and 4 are kept; step 1 holds the frozen bytes both refer to
    assert _steps.committed_steps(str(tmp_path)) == [1, 3, 4]
    assert stats.bytes_referenced >= 3 * frozen.numel() * 2
    for step in (3, 4):
        m = gds_persist.read_manifest(_steps.step_path(str(tmp_path), step))
        assert {b.name for b in m.bases} <= {"step-00000001", f"step-{step - 1:08d}"}
        got = gds_persist.load(_steps.step_path(str(tmp_path), step))
        assert _bits(got["frozen"]) == _bits(frozen)
        assert _bits(got["trained"]) == _bits(states[step]["trained"])
    # resuming continues the chain against the loaded step
    with gds_persist.Checkpointer(tmp_path, keep_last=2, incremental=True) as ckpt:
        assert ckpt.load()["step"] == 4
        info = ckpt.save(5, {"frozen": frozen, "trained": torch.ones(50_000), "step": 5},
                         blocking=True).wait()
        assert info.referenced_bytes == frozen.numel() * 2


def test_retention_reads_the_bases_of_a_damaged_manifest_too(tmp_path):
    """Retention reads only a kept step's ``bases`` (format.base_names, not a full parse): the
    names a valid manifest gives, those a damaged one still names, none from garbage."""
    frozen = torch.randn(100_000)
    with gds_persist.Checkpointer(tmp_path, keep_last=3, incremental=True) as ckpt:
        _train_steps(ckpt, 2, frozen)
    raw = (tmp_path / "step-00000002" / "manifest.json").read_bytes()
    parsed = gds_persist.read_manifest(_steps.step_path(str(tmp_path), 2))
    assert base_names(raw) == {b.name for b in parsed.bases} == {"step-00000001"}
    damaged = raw.replace(b'"body_crc32c": ', b'"body_crc32c": 1')  # fails the full parse
    with pytest.raises(gds_persist.ManifestError):
        parse_manifest(damaged, "damaged")
    assert base_names(damaged) == {"step-00000001"}
    for garbage in (b"", b"{", b"[]", b'{"body": []}', b'{"body": {"bases": [1, {"name": 2}]}}'):
        assert base_names(garbage) == set(), garbage


def test_checkpointer_helper_process_writes_incrementally(tmp_path):
    frozen = torch.randn(200_000)
    with gds_persist.Checkpointer(tmp_path, keep_last=1, mode="snapshot", writer="process",
                                  incremental=True) as ckpt:
        _train_steps(ckpt, 2, frozen)
        assert ckpt.stats.bytes_referenced == frozen.numel() * 4
    assert _steps.committed_steps(str(tmp_path)) == [1, 2]


def test_manifest_json_records_the_choice(tmp_path):
    gds_persist.save(_state(), tmp_path / "c",
                     options=gds_persist.SaveOptions(compression="lossless"))
    body = json.loads((tmp_path / "c" / "manifest.json").read_text())["body"]
    assert body["writer"]["compression"]["applied"] is True
    assert body["bases"] == []
    assert {"codec", "stored", "stored_crc32c", "blake3"} <= set(body["extents"][0])


def test_encoded_extents_larger_than_the_readers_staging_buffers(tmp_path):
    """A reader with small staging buffers reads an encoded 16 MiB unit through its own one."""
    state = {"w": (torch.randn(3 << 20) * 0.02).to(torch.bfloat16)}  # 6 MiB, one unit
    gds_persist.save(state, tmp_path / "c", options=gds_persist.SaveOptions(compression="lossless"))
    (e,) = gds_persist.read_manifest(tmp_path / "c").extents
    assert e.encoded and e.stored > 64 << 10
    with gds_persist.settings.set(block_bytes=64 << 10, staging_bytes=128 << 10):
        _saved_bytes_equal(gds_persist.load(tmp_path / "c"), state)
        assert gds_persist.verify(tmp_path / "c").ok
