"""Format version 2 (rank-local sections, external data directories), in one process.

Version 1 stays what plain saves write; version 2 fields are validated like the rest, and a
manifest cannot make a load read outside the directories a save created.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist.errors import ManifestError
from gds_persist.format import crc32c, parse_manifest


def _state() -> dict[str, Any]:
    emb = torch.arange(3000 * 7, dtype=torch.float32).reshape(3000, 7)
    return {"model": {"emb": emb, "head": emb, "bias": torch.ones(3)},
            "optim": {"shard": torch.arange(10), "lr": 0.5}, "step": 7}


def _rewrite(path: Path, edit: Any) -> None:
    """Edit a manifest's body and re-seal it (a hostile but well-formed manifest)."""
    doc = json.loads((path / "manifest.json").read_text())
    edit(doc)
    body = json.dumps(doc["body"], sort_keys=True, separators=(",", ":")).encode()
    doc["body_crc32c"] = crc32c(body)
    (path / "manifest.json").write_text(json.dumps(doc))


def test_plain_save_still_writes_version_1(tmp_path: Path) -> None:
    gds_persist.save(_state(), tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert raw["version"] == 1 and "dirs" not in raw["body"]
    assert set(raw["body"]["files"][0]) == {"name", "size"}


def test_rank_local_without_process_group(tmp_path: Path) -> None:
    info = gds_persist.save(_state(), tmp_path / "c", rank_local=["optim"])
    assert info.rank_files == ["data-r00000-00000.bin", "local-r00000-00000.bin"]
    assert "NVML" in info.placement  # the NVML probe's outcome is reported, whatever it was
    m = gds_persist.read_manifest(tmp_path / "c")
    assert m.version == 2 and [s.rank for s in m.sections] == [0]
    out = gds_persist.load(tmp_path / "c")
    assert list(out["optim"]) == [0] and out["optim"][0]["lr"] == 0.5
    out = gds_persist.load(tmp_path / "c", options=gds_persist.LoadOptions(rank_local=0))
    assert torch.equal(out["optim"]["shard"], torch.arange(10)) and out["step"] == 7
    assert out["model"]["emb"].data_ptr() == out["model"]["head"].data_ptr()
    with pytest.raises(ManifestError, match="no rank-local state for rank 3"):
        gds_persist.load(tmp_path / "c", options=gds_persist.LoadOptions(rank_local=3))
    assert gds_persist.verify(tmp_path / "c").ok


@pytest.mark.parametrize("paths", [["optim", ("optim", "lr")], ["nope"], [("model", "emb", "x")]])
def test_bad_rank_local_paths(tmp_path: Path, paths: list[Any]) -> None:
    with pytest.raises((ValueError, KeyError),
                       match="overlap|not in the state dict|does not index"):
        gds_persist.save(_state(), tmp_path / "c", rank_local=paths)
    assert not (tmp_path / "c").exists()


def test_placeholders_follow_tree_order(tmp_path: Path) -> None:
    state = {"a": {"x": torch.ones(2)}, "b": torch.zeros(3), "c": [torch.ones(1), 5]}
    gds_persist.save(state, tmp_path / "c", rank_local=[("c", 1), "a"])
    out = gds_persist.load(tmp_path / "c", options=gds_persist.LoadOptions(rank_local=0))
    assert out["c"][1] == 5 and torch.equal(out["a"]["x"], torch.ones(2))


def test_data_dirs_in_one_process(tmp_path: Path) -> None:
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    info = gds_persist.save(_state(), tmp_path / "c",
                            options=gds_persist.SaveOptions(data_dirs=roots))
    m = gds_persist.read_manifest(tmp_path / "c")
    assert [d.root for d in m.dirs] == [str(roots[0])] and m.files[0].dir == 1
    assert info.rank_files == ["data-r00000-00000.bin"]
    assert os.listdir(tmp_path / "c") == ["manifest.json"]
    assert torch.equal(gds_persist.load(tmp_path / "c")["model"]["emb"], _state()["model"]["emb"])


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["body"]["dirs"][0].update(root="relative/dir"), "absolute, normalised"),
    (lambda d: d["body"]["dirs"][0].update(root="/a/../etc"), "absolute, normalised"),
    (lambda d: d["body"]["dirs"][0].update(name="etc"), "data directory name"),
    (lambda d: d["body"]["dirs"][0].update(name="../x.gds-abcdef"), "data directory name"),
    (lambda d: d["body"]["files"][0].update(dir=5), "is not 0"),
    (lambda d: d["body"]["files"][0].update(name="../data.bin"), "plain file name"),
    (lambda d: d["body"]["sections"].append({"rank": 0, "tree": {"t": "list", "v": []}}),
     "list of 1 subtrees"),
    (lambda d: d["body"]["sections"].append(dict(d["body"]["sections"][0])), "same rank"),
    (lambda d: d["body"]["tree"]["v"][1].update(i=1), "is not valid"),
    (lambda d: d.update(version=1), "exactly the fields"),
    (lambda d: d.update(version=5), "version 5 is not supported"),
])
def test_hostile_version_2_manifests_are_rejected(tmp_path: Path, edit: Any, message: str) -> None:
    gds_persist.save(_state(), tmp_path / "c", rank_local="optim",
                     options=gds_persist.SaveOptions(data_dirs=[tmp_path / "d"]))
    _rewrite(tmp_path / "c", edit)
    with pytest.raises(ManifestError, match=message):
        gds_persist.load(tmp_path / "c")


def test_symlinked_data_file_cannot_escape(tmp_path: Path) -> None:
    gds_persist.save(_state(), tmp_path / "c",
                     options=gds_persist.SaveOptions(data_dirs=[tmp_path / "d"]))
    stripe = next((tmp_path / "d").iterdir())
    secret = tmp_path / "secret.bin"
    (stripe / "data-r00000-00000.bin").rename(secret)
    (stripe / "data-r00000-00000.bin").symlink_to(secret)
    with pytest.raises(ManifestError, match="outside its directory"):
        gds_persist.load(tmp_path / "c")


def test_v1_reader_semantics_unchanged_for_unknown_node(tmp_path: Path) -> None:
    """A 'local' placeholder is only valid in a version-2 manifest."""
    gds_persist.save(_state(), tmp_path / "c")

    def edit(d: dict[str, Any]) -> None:
        d["body"]["tree"]["v"][2] = {"t": "local", "i": 0}

    _rewrite(tmp_path / "c", edit)
    with pytest.raises(ManifestError, match="is not valid"):
        parse_manifest((tmp_path / "c" / "manifest.json").read_bytes(), "m")


def test_cli_inspect_and_verify_version_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from gds_persist.cli import main

    gds_persist.save(_state(), tmp_path / "c", rank_local="optim",
                     options=gds_persist.SaveOptions(data_dirs=[tmp_path / "d"]))
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "rank-local state of ranks [0]" in out and f"in {tmp_path / 'd'}/" in out
    assert "['optim'][0]['shard']" in out
    (tmp_path / "d").rename(tmp_path / "moved")
    assert main(["verify", str(tmp_path / "c")]) == 2
    assert "is missing" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "c"), "--data-dir",
                 f"{tmp_path / 'd'}={tmp_path / 'moved'}"]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_export_of_a_version_2_checkpoint(tmp_path: Path) -> None:
    """Export (gds_persist.convert) reads files from data directories and rank-local sections."""
    from safetensors.torch import load_file

    gds_persist.save(_state(), tmp_path / "c", rank_local="optim",
                     options=gds_persist.SaveOptions(data_dirs=[tmp_path / "d"]))
    gds_persist.export_checkpoint(tmp_path / "c", tmp_path / "c.safetensors")
    out = load_file(str(tmp_path / "c.safetensors"))
    assert torch.equal(out["model.emb"], _state()["model"]["emb"])
    assert torch.equal(out["optim.0.shard"], torch.arange(10))
