"""The API a user meets (issue 39): ``save`` / ``load`` keywords and their options objects, 0.1's
keywords refused naming their new spelling, settings with units, and what a newcomer tries:
``into=model``, ``~`` in paths, a non-int step, a load from a root that does not exist."""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist import LoadOptions, MemoryTier, SaveOptions, settings
from gds_persist.cli import main as cli_main
from gds_persist.dcp import GdsPersistWriter
from gds_persist.keywords import removed_keywords


def _sd() -> dict[str, Any]:
    return {"w": torch.arange(1000, dtype=torch.float32), "step": 3}


@pytest.mark.parametrize("fn", [gds_persist.save, gds_persist.load, gds_persist.load_with_info])
def test_save_and_load_take_at_most_8_keywords(fn: Any) -> None:
    params = inspect.signature(fn).parameters.values()
    assert len([p for p in params if p.kind is p.KEYWORD_ONLY]) <= 8
    assert "options" in inspect.signature(fn).parameters
    assert "Parameters\n    ----------" in (fn.__doc__ or "") or "as :func:`load`" in fn.__doc__


SETTING = r"{0} is a setting since 0.2: use `with gds_persist.settings.set\({0}=...\)`"
MOVED = [  # (callable, keyword, the new spelling the TypeError names)
    *[(gds_persist.save, k, SETTING.format(k))
      for k in ("block_bytes", "staging_bytes", "io_threads")],
    *[(gds_persist.save, k, rf"use options=gds_persist.SaveOptions\({k}=...\)")
      for k in ("compression", "content_hash", "writers_per_node", "data_dirs", "check_replicas")],
    *[(f, k, rf"use options=gds_persist.LoadOptions\({k}=...\)")
      for f in (gds_persist.load, gds_persist.load_with_info)
      for k in ("strategy", "rank_local", "data_dirs", "weights_only")],
    (gds_persist.load, "return_info", r"`state, info = gds_persist.load_with_info\(path, ...\)`"),
    *[(gds_persist.warmup, k, SETTING.format(k))
      for k in ("block_bytes", "staging_bytes", "io_threads")],
    *[(GdsPersistWriter, k, SETTING.format(k))
      for k in ("block_bytes", "staging_bytes", "io_threads")],
    *[(gds_persist.Checkpointer, k, SETTING.format(k))
      for k in ("block_bytes", "staging_bytes", "io_threads")],
    *[(gds_persist.Checkpointer, k, rf"use memory=gds_persist.MemoryTier\(root=...{f}\)$")
      for k, f in (("memory_root", ""), ("memory_every", ", every=..."),
                   ("replicas", ", replicas=..."), ("peer_timeout_s", ", peer_timeout_s=..."))],
]


@pytest.mark.parametrize("fn, keyword, spelling", MOVED,
                         ids=[f"{getattr(f, '__name__', f)}-{k}" for f, k, _ in MOVED])
def test_a_keyword_of_0_1_raises_naming_its_new_spelling(tmp_path: Path, fn: Any, keyword: str,
                                                         spelling: str) -> None:
    path = tmp_path / "ck"
    args = [] if fn is gds_persist.warmup else [_sd(), path] if fn is gds_persist.save else [path]
    name = fn.__name__
    with pytest.raises(TypeError, match=rf"^{name}\({keyword}=...\): (.* )?{spelling}"):
        fn(*args, **{keyword: 1})
    assert os.listdir(tmp_path) == []  # refused before anything was done


def test_removed_keywords_keeps_the_signature_and_passes_other_calls_through() -> None:
    @removed_keywords({"old": "old is gone: use new"})
    def f(a: int, *, new: int = 0) -> int:
        """Doc."""
        return a + new

    assert f(1, new=2) == 3 and f.__doc__ == "Doc."
    assert list(inspect.signature(f).parameters) == ["a", "new"]
    with pytest.raises(TypeError, match=r"^f\(old=...\): old is gone: use new$"):
        f(1, old=2)


def test_an_unknown_keyword_of_load_names_load(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^load\(\): got an unexpected keyword argument 'bogus'"):
        gds_persist.load(tmp_path, bogus=1)


def test_options_objects_reach_the_save_and_the_load(tmp_path: Path) -> None:
    sd = _sd()
    info = gds_persist.save(sd, tmp_path / "a", options=SaveOptions(content_hash=True,
                                                                    compression="lossless"))
    assert info.compression in ("lossless", "none")  # the codec may be missing: then raw
    assert gds_persist.read_manifest(tmp_path / "a").version == 4  # units: hashes recorded
    state = gds_persist.load(tmp_path / "a", options=LoadOptions(rank_local="all"))
    assert torch.equal(state["w"], sd["w"])
    state, info = gds_persist.load_with_info(tmp_path / "a")
    assert torch.equal(state["w"], sd["w"]) and info.payload_bytes == 4000
    with pytest.raises(ValueError, match="format='torch' .* content_hash="):
        gds_persist.save(sd, tmp_path / "b.pt", format="torch",
                         options=SaveOptions(content_hash=True))


def test_settings_context_manager_tunes_one_save(tmp_path: Path) -> None:
    with gds_persist.settings.set(io_threads=3, block_bytes="8KiB") as inside:
        assert (inside.io_threads, inside.block_bytes) == (3, 8192)
        gds_persist.save(_sd(), tmp_path / "a")
    assert settings.current() == settings.Settings()  # restored on exit
    assert torch.equal(gds_persist.load(tmp_path / "a")["w"], _sd()["w"])


def test_in_this_thread_changes_no_other_thread() -> None:
    seen: list[int] = []
    with settings.in_this_thread(io_threads=7):
        other = threading.Thread(target=lambda: seen.append(settings.current().io_threads))
        other.start()
        other.join()
        assert settings.current().io_threads == 7
    assert seen == [4] and settings.current().io_threads == 4


@pytest.mark.parametrize("text, nbytes", [
    ("128MB", 128_000_000), ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("33554432", 32 << 20),
    ("32768 KiB", 32 << 20), ("2gb", 2_000_000_000), ("40.5MiB", 81 << 19)])
def test_byte_settings_take_units(monkeypatch: pytest.MonkeyPatch, text: str,
                                  nbytes: int) -> None:
    monkeypatch.setenv("GDS_PERSIST_STAGING_BYTES", text)
    assert settings.current().staging_bytes == nbytes
    monkeypatch.delenv("GDS_PERSIST_STAGING_BYTES")
    with settings.set(staging_bytes=text):
        assert settings.current().staging_bytes == nbytes


@pytest.mark.parametrize("text", ["128XB", "lots", "1.3B", "-4KiB"])
def test_a_bad_size_names_the_environment_variable(monkeypatch: pytest.MonkeyPatch,
                                                   text: str) -> None:
    monkeypatch.setenv("GDS_PERSIST_STAGING_BYTES", text)
    with pytest.raises(ValueError, match=r"staging_bytes=.* \(environment variable "
                                         r"GDS_PERSIST_STAGING_BYTES\) must be a size in bytes"):
        settings.current()


@pytest.mark.parametrize("into, says", [
    (torch.nn.Linear(2, 2), r"a state dict, not a Linear: pass into=model.state_dict\(\)"),
    (torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), "a state dict, not a SGD"),
    ("ck", r"the state dict to fill, not a str path \('ck'\): the checkpoint's path is load's "
           "first argument"),
    (Path("ck"), "the state dict to fill, not a PosixPath path"),
    (3, "a state dict .* not a int"),
])
def test_load_into_a_module_or_a_path_says_what_to_pass(tmp_path: Path, into: Any,
                                                        says: str) -> None:
    gds_persist.save(_sd(), tmp_path / "ck")
    before = [p.detach().clone() for p in into.parameters()] if hasattr(into, "parameters") else []
    with pytest.raises(TypeError, match=rf"load\(into=...\) takes {says}"):
        gds_persist.load(tmp_path / "ck", into=into, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(before, into.parameters(), strict=True)) \
        if before else True
    with gds_persist.Checkpointer(tmp_path / "root", warmup=False) as ckpt:
        ckpt.save(1, _sd(), blocking=True)
        with pytest.raises(TypeError, match=r"load\(into=...\) takes"):
            ckpt.load(into=into)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``~`` is ``tmp_path/home`` and the working directory ``tmp_path/cwd``."""
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


def test_tilde_is_the_home_directory(home: Path, tmp_path: Path) -> None:
    sd = _sd()
    gds_persist.save(sd, "~/ck", options=SaveOptions(content_hash=True))
    assert (home / "ck").is_dir() and not (tmp_path / "cwd" / "~").exists()
    assert torch.equal(gds_persist.load("~/ck")["w"], sd["w"])
    assert gds_persist.verify("~/ck").ok
    gds_persist.save(sd, "~/ck2", base="~/ck")
    assert cli_main(["verify", "~/ck"]) == 0
    with gds_persist.Checkpointer("~/run", warmup=False,
                                  memory=MemoryTier("~/mem")) as ckpt:
        ckpt.save(1, sd, blocking=True)
        assert ckpt.root == str(home / "run") and (home / "mem").is_dir()
    assert os.listdir(tmp_path / "cwd") == []


def test_a_step_that_is_not_an_int_is_refused_at_the_call(tmp_path: Path) -> None:
    with gds_persist.Checkpointer(tmp_path, warmup=False) as ckpt:
        with pytest.raises(TypeError, match=r"Checkpointer.save\(step='a', ...\): step must be "
                                            "an int .* not a str"):
            ckpt.save("a", _sd())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"step=\{'step': 3, 'w': .* not a dict; the state "
                                            "comes second"):
            ckpt.save(_sd(), 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not a bool"):
            ckpt.save(True, _sd())
        assert ckpt.steps() == []


def test_loading_from_a_root_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    with gds_persist.Checkpointer(tmp_path / "typo") as ckpt:  # warm-up included
        with pytest.raises(gds_persist.NotCommittedError, match="no committed checkpoint in "):
            ckpt.load()
        assert ckpt.latest_step() is None and ckpt.steps() == []
        if ckpt._warmup is not None:
            ckpt._warmup.wait(60)
    assert os.listdir(tmp_path) == []
    with gds_persist.Checkpointer(tmp_path / "typo") as ckpt:
        ckpt.save(1, _sd(), blocking=True)  # the first save creates the root
    assert os.listdir(tmp_path) == ["typo"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(gds_persist.NotACheckpointDirectoryError, match="is a file"):
        gds_persist.Checkpointer(tmp_path / "file" / "ckpt")
