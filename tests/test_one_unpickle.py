"""A load of a torch.save file runs its pickle once where it can: over the destination storages,
before any byte is read, so the run that builds the state is also the weights-only check. It
runs twice (checked first, rebuilt after the read) where a ``map_location`` callable moves the
storages after the read, and only after the read for a trusted pickle (``weights_only=False``),
whose code may read the bytes."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.format import torch_pickle


@pytest.fixture
def unpickles(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every run of the file's pickle, as ``weights_only`` (the real unpickler runs)."""
    runs: list[bool] = []
    real = torch_pickle.unpickle

    def counted(data, storage_for, weights_only):  # type: ignore[no-untyped-def]
        runs.append(weights_only)
        return real(data, storage_for, weights_only)

    monkeypatch.setattr(torch_pickle, "unpickle", counted)
    monkeypatch.setattr("gds_persist.loading.single_file.unpickle", counted)
    return runs


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(3, 1 << 16), "b": torch.arange(7.0), "step": torch.tensor(4)}


def test_a_load_runs_the_pickle_once_and_returns_the_bytes(tmp_path: Path,
                                                           unpickles: list[bool]) -> None:
    state = _state()
    gds_persist.save(state, tmp_path / "a.pt", format="torch")
    got = gds_persist.load(tmp_path / "a.pt")
    assert unpickles == [True]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    got = gds_persist.load(tmp_path / "a.pt", into=live)
    assert unpickles == [True, True]  # one more run for the second load
    assert all(got[k] is live[k] and torch.equal(live[k], v) for k, v in state.items())
    stock = tmp_path / "stock.pt"
    torch.save(state, stock)  # a foreign file: the same single run
    got = gds_persist.load(stock, map_location="cpu")
    assert unpickles == [True, True, True]
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_map_location_callable_keeps_the_check_before_the_read(tmp_path: Path,
                                                                 unpickles: list[bool]) -> None:
    state = _state()
    gds_persist.save(state, tmp_path / "a.pt", format="torch")
    got = gds_persist.load(tmp_path / "a.pt", map_location=lambda storage, where: storage)
    assert unpickles == [True, True]  # checked over meta storages, then rebuilt
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_trusted_pickle_runs_once_after_the_read(tmp_path: Path,
                                                   unpickles: list[bool]) -> None:
    state = {"w": torch.ones(2), "args": Namespace(lr=0.1)}
    gds_persist.save(state, tmp_path / "a.pt", format="torch", allow_pickle=True)
    got = gds_persist.load(tmp_path / "a.pt",
                           options=gds_persist.LoadOptions(weights_only=False))
    assert unpickles == [False]
    assert got["args"] == state["args"] and torch.equal(got["w"], state["w"])


def test_a_refused_pickle_stops_a_restore_before_any_byte_reaches_it(
        tmp_path: Path, unpickles: list[bool]) -> None:
    state = {"w": torch.arange(4096.0), "args": Namespace(lr=0.1)}
    gds_persist.save(state, tmp_path / "a.pt", format="torch", allow_pickle=True)
    live = {"w": torch.zeros(4096), "args": Namespace(lr=0.5)}
    with pytest.raises(gds_persist.PickleRefusedError,
                       match=r"weights_only=False.*Nothing was read") as caught:
        gds_persist.load(tmp_path / "a.pt", into=live)
    assert "partial data" not in str(caught.value)  # nothing of into= was touched
    assert not hasattr(caught.value, "partial_keys")
    assert torch.equal(live["w"], torch.zeros(4096))
    assert unpickles == [True]
