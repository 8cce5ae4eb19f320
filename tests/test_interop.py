"""torch.save / safetensors export and import (gds_persist.convert and the CLI commands)."""

from __future__ import annotations

import io
import math
import os
from collections import OrderedDict

import pytest
import safetensors.torch as st
import torch

import gds_persist
from gds_persist import CheckpointError, ChecksumError, export_checkpoint, import_checkpoint
from gds_persist.cli import main
from gds_persist.convert.importing import detect_format
from gds_persist.convert.safetensors import ST_DTYPES


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    emb = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    model = OrderedDict(
        [
            ("emb.weight", emb),
            ("head.weight", emb),  # tied: same storage, same view
            ("fc.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
            ("fc.bias", torch.randn(8, generator=g)),
            ("t", torch.randn(5, 7, generator=g).t()),  # non-contiguous view
            ("half", torch.randn(10, generator=g)[2:6]),  # a view into part of a storage
            ("mask", torch.rand(9, generator=g) > 0.5),
            ("empty", torch.empty(0, 4)),
            ("scalar", torch.tensor(2.5)),
        ]
    )
    model._metadata = OrderedDict([("", {"version": 1})])
    return {
        "model": model,
        "optim": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(64, 16)}},
            "param_groups": [
                {
                    "lr": 1e-3,
                    "betas": (0.9, 0.999),
                    "eps": float("inf"),
                    "weight_decay": float("nan"),
                    "params": [0],
                    "name": None,
                }
            ],
        },
        "epoch": 4,
        "tag": "run-a",
        "done": False,
    }


def assert_same(a, b, path="root"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert (
            torch.equal(
                a.detach().reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a,
                b.detach().reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b,
            )
            if a.numel()
            else True
        ), path
        assert isinstance(a, torch.nn.Parameter) == isinstance(b, torch.nn.Parameter), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b and type(a) is type(b), path


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    gds_persist.save(state(), path)
    return path


def test_export_torch_loads_with_weights_only(ckpt, tmp_path):
    out = str(tmp_path / "out.pt")
    info = export_checkpoint(ckpt, out, to="torch")
    assert info.to == "torch" and os.path.getsize(out) == info.bytes_written
    back = torch.load(out, weights_only=True)
    assert_same(state(), back)
    assert shares(back["model"]["emb.weight"], back["model"]["head.weight"])
    assert back["model"]["t"].stride() == state()["model"]["t"].stride()  # views kept
    assert back["model"]._metadata == {"": {"version": 1}}


def test_export_safetensors_loads_with_load_file_and_imports_back_exactly(ckpt, tmp_path):
    out = str(tmp_path / "out.safetensors")
    info = export_checkpoint(ckpt, out)  # format from the suffix
    assert info.to == "safetensors"
    flat = st.load_file(out)
    sd = state()
    assert sorted(flat) == sorted(
        [
            "model.emb.weight",
            "model.head.weight",
            "model.fc.weight",
            "model.fc.bias",
            "model.t",
            "model.half",
            "model.mask",
            "model.empty",
            "model.scalar",
            "optim.state.0.step",
            "optim.state.0.exp_avg",
        ]
    )
    for name, t in flat.items():
        keys = name.split(".", 1)
        src = (
            sd[keys[0]][keys[1]]
            if keys[0] == "model"
            else sd["optim"]["state"][0][name.split(".")[-1]]
        )
        assert t.is_contiguous() and torch.equal(t, src.detach().contiguous()), name
    assert any("tied" in n for n in info.notes) and any("non-contiguous" in n for n in info.notes)

    back_path = str(tmp_path / "back")
    import_checkpoint(out, back_path)
    back = gds_persist.load(back_path)
    assert_same(sd, back)  # nesting, leaves (inf/nan/None/str/bool), Parameters
    assert shares(back["model"]["emb.weight"], back["model"]["head.weight"])  # re-tied


@pytest.mark.parametrize("dtype", sorted(ST_DTYPES, key=str), ids=str)
def test_every_safetensors_dtype_round_trips(dtype, tmp_path):
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    t = (t > 10) if dtype == torch.bool else t.to(dtype)
    gds_persist.save({"x": t}, str(tmp_path / "ck"))
    out = str(tmp_path / "x.safetensors")
    export_checkpoint(str(tmp_path / "ck"), out)
    got = st.load_file(out)["x"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_what_safetensors_cannot_hold_is_refused_with_the_key(tmp_path):
    gds_persist.save({"a": {"z": torch.zeros(2, dtype=torch.complex128)}}, str(tmp_path / "c1"))
    with pytest.raises(TypeError, match=r"\['a'\]\['z'\].*complex128.*to='torch'"):
        export_checkpoint(str(tmp_path / "c1"), str(tmp_path / "o.safetensors"))
    gds_persist.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, str(tmp_path / "c2"))
    with pytest.raises(ValueError, match="both become 'a.b'.*separator"):
        export_checkpoint(str(tmp_path / "c2"), str(tmp_path / "o.safetensors"))
    export_checkpoint(str(tmp_path / "c2"), str(tmp_path / "o.safetensors"), sep="/")
    assert sorted(st.load_file(str(tmp_path / "o.safetensors"))) == ["a.b", "a/b"]
    assert sorted(os.listdir(tmp_path)) == ["c1", "c2", "o.safetensors"]  # nothing half-written


def test_streaming_export_of_tensors_larger_than_a_block(tmp_path):
    big = torch.randn(300_000)  # 1.2 MB, a few 256 KiB blocks
    sd = {"big": big, "tail": big[1000:5000], "other": torch.arange(1000)}
    gds_persist.save(sd, str(tmp_path / "ck"))
    out = str(tmp_path / "o.safetensors")
    with gds_persist.settings.set(block_bytes=256 << 10, staging_bytes=512 << 10):
        export_checkpoint(str(tmp_path / "ck"), out)
    flat = st.load_file(out)
    assert torch.equal(flat["big"], big) and torch.equal(flat["tail"], big[1000:5000])
    assert torch.equal(flat["other"], sd["other"])


def test_export_detects_corruption_and_leaves_no_output(ckpt, tmp_path):
    m = gds_persist.read_manifest(ckpt)
    e = max(m.extents, key=lambda e: e.length)
    with open(os.path.join(ckpt, m.files[e.file].name), "r+b") as f:
        f.seek(e.offset + 7)
        b = f.read(1)
        f.seek(e.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    for out, pattern in (
        ("o.safetensors", r"checksum mismatch in tensor \['model'\]\['emb.weight'\]"),
        ("o.pt", r"checksum mismatch in tensor \['model'\]\['emb.weight'\]"),
    ):
        with pytest.raises(ChecksumError, match=pattern):
            export_checkpoint(ckpt, str(tmp_path / out))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_import_torch_files_zip_and_legacy(tmp_path):
    sd = state()
    for legacy in (False, True):
        f = str(tmp_path / f"in-{legacy}.pt")
        torch.save(sd, f, _use_new_zipfile_serialization=not legacy)
        assert detect_format(f) == "torch"
        path = str(tmp_path / f"ck-{legacy}")
        info = import_checkpoint(f, path)
        assert info.tensors == 11
        back = gds_persist.load(path)
        assert_same(sd, back)
        assert shares(back["model"]["emb.weight"], back["model"]["head.weight"])


class Evil:
    """Unpickling this with weights_only=False would create a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_import_never_unpickles_arbitrary_code(tmp_path):
    marker = str(tmp_path / "pwned")
    f = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, f)
    with pytest.raises(CheckpointError, match="weights_only=True.*never unpickles"):
        import_checkpoint(f, str(tmp_path / "ck"))
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "ck")


def test_import_foreign_safetensors_file_gives_a_flat_dict(tmp_path):
    tensors = {
        "a.weight": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int16),
        "odd": torch.arange(3, dtype=torch.uint8),
    }  # makes the next offsets unaligned
    tensors["z.after_odd"] = torch.randn(7, dtype=torch.float64)
    f = str(tmp_path / "m.safetensors")
    st.save_file(tensors, f, metadata={"format": "pt"})
    assert detect_format(f) == "safetensors"
    import_checkpoint(f, str(tmp_path / "ck"))
    back = gds_persist.load(str(tmp_path / "ck"))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert torch.equal(back[k], v)


def test_import_rejects_garbage(tmp_path):
    f = tmp_path / "junk.bin"
    f.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(ValueError, match="neither a torch.save file nor a safetensors file"):
        import_checkpoint(str(f), str(tmp_path / "ck"))
    bad = tmp_path / "bad.safetensors"
    header = b'{"x":{"dtype":"F32"}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="'x'"):
        import_checkpoint(str(bad), str(tmp_path / "ck"), format="safetensors")


def test_export_of_a_dcp_checkpoint_is_consolidated(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from gds_persist.dcp import GdsPersistWriter

    sd = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}, "step": 12}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=GdsPersistWriter(str(tmp_path / "ck")), no_dist=True)
    export_checkpoint(str(tmp_path / "ck"), str(tmp_path / "o.pt"), to="torch")
    back = torch.load(str(tmp_path / "o.pt"), weights_only=True)
    assert torch.equal(back["model"]["w"], sd["model"]["w"]) and back["step"] == 12
    export_checkpoint(str(tmp_path / "ck"), str(tmp_path / "o.safetensors"))
    flat = st.load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(flat["model.b"], sd["model"]["b"])


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_export_import_quiet_when_not_a_terminal(ckpt, tmp_path, capsys):
    out = str(tmp_path / "o.safetensors")
    assert main(["export", ckpt, "--to", "safetensors", out]) == 0
    assert main(["import", out, str(tmp_path / "back")]) == 0
    assert main(["export", ckpt, "--to", "torch", str(tmp_path / "o.pt")]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "GB/s" not in captured.err
    assert "exported" in captured.out and "imported" in captured.out
    assert_same(state(), gds_persist.load(str(tmp_path / "back")))


def test_cli_shows_a_progress_bar_on_a_terminal(ckpt, tmp_path, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    assert main(["export", ckpt, "--to", "safetensors", str(tmp_path / "o.safetensors")]) == 0
    assert main(["verify", ckpt]) == 0
    assert main(["import", str(tmp_path / "o.safetensors"), str(tmp_path / "b")]) == 0
    text = tty.getvalue()
    for label in ("export safetensors [", "verify [", "import ["):
        assert label in text
    assert "100.0%" in text and "GB/s" in text


def test_cli_errors_name_the_problem(tmp_path, capsys):
    f = str(tmp_path / "evil.pt")
    torch.save({"payload": Evil(str(tmp_path / "pwned"))}, f)
    assert main(["import", f, str(tmp_path / "ck")]) == 2
    assert "weights_only=True" in capsys.readouterr().err
