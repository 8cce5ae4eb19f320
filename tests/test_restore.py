"""Restore in place: ``load(into=state)`` fills the caller's tensors with the checkpoint's bytes.

Real checkpoints on the real filesystem (O_DIRECT where it is accepted), real torch modules and
optimizers. What is checked: the same tensor objects come back at the same addresses holding the
saved bytes; strictness as ``load_state_dict``; ties, views and non-contiguous destinations;
every dtype; corruption raising and naming what may be partial; incremental and compressed
checkpoints; a bounded memory growth (VmHWM of a fresh process).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _dist_tasks as tasks
import pytest
import torch

import gds_persist
from gds_persist.loading.destinations import tensor_leaves


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 10))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}


def _clone(obj: Any) -> Any:
    return {k: v.clone() for k, v in obj.items()}


def _addresses(obj: Any) -> list[tuple[Any, int, int]]:
    return [(p, id(t), t.data_ptr()) for p, t in tensor_leaves(obj)]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _trained(0)
    gds_persist.save(_state(model, opt), tmp_path / "ckpt")
    return tmp_path / "ckpt", model, opt


def test_fills_a_live_model_and_optimizer_in_place(saved: Any) -> None:
    path, want_model, want_opt = saved
    model, opt = _trained(1)  # other values, state already created
    live = {"model": model.state_dict(), "optim": opt.state_dict()}
    before = _addresses(live)
    state = gds_persist.load(path, into=live)
    assert _addresses({"model": state["model"], "optim": state["optim"]}) == before
    assert state["step"] == 2  # non-tensor leaves come from the checkpoint
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_model.state_dict()[k]), k
    opt.load_state_dict(state["optim"])  # hyperparameters; the moments stay where they are
    assert _addresses(opt.state_dict()) == _addresses(live["optim"])
    # training goes on exactly as it would have from the saved state
    x = torch.randn(8, 32)
    for m, o in ((model, opt), (want_model, want_opt)):
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_init_optimizer_state_lets_a_fresh_optimizer_be_filled_in_place(saved: Any) -> None:
    path, want_model, want_opt = saved
    model = _model(5)
    params = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gds_persist.init_optimizer_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params, strict=True))
    assert opt.param_groups[0]["lr"] == 1e-2 and all(p.grad is None for p in model.parameters())
    live = {"model": model.state_dict(), "optim": opt.state_dict()}
    state, info = gds_persist.load_with_info(path, into=live)
    assert info.in_place_bytes == info.payload_bytes and not info.unexpected_keys
    moments = opt.state[next(model.parameters())]
    want = want_opt.state[next(want_model.parameters())]
    assert torch.equal(moments["exp_avg_sq"], want["exp_avg_sq"])
    assert torch.equal(moments["step"], want["step"])
    assert state["optim"]["state"][0]["exp_avg"] is moments["exp_avg"]


def test_init_optimizer_state_refuses_pending_gradients() -> None:
    model = _model(0)
    model(torch.randn(2, 32)).sum().backward()
    with pytest.raises(ValueError, match="already hold gradients"):
        gds_persist.init_optimizer_state(torch.optim.Adam(model.parameters()))


def test_strict_lists_every_mismatch_before_reading(saved: Any) -> None:
    path, _, _ = saved
    model, opt = _trained(1)
    live = {"model": model.state_dict(), "optim": opt.state_dict()}
    live["model"]["0.weight"] = torch.zeros(3, 3)
    live["model"]["3.bias"] = torch.zeros(10, dtype=torch.float64)
    live["model"]["extra"] = torch.zeros(1)
    del live["model"]["2.bias"]
    untouched = _clone(live["model"])
    with pytest.raises(gds_persist.StateMismatchError) as err:
        gds_persist.load(path, into=live)
    message = str(err.value)
    for expected in ("['model']['0.weight']: saved float32 [64, 32], given float32 [3, 3]",
                     "['model']['3.bias']: saved float32 [10], given float64 [10]",
                     "missing from the checkpoint: ['model']['extra']",
                     "in the checkpoint but not in into=: ['model']['2.bias']",
                     "Nothing was read"):
        assert expected in message
    assert isinstance(err.value, ValueError)
    for k, v in untouched.items():
        assert torch.equal(live["model"][k], v), k


def test_not_strict_fills_what_matches_and_reports_the_rest(
        saved: Any, caplog: pytest.LogCaptureFixture) -> None:
    path, want_model, want_opt = saved
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters())  # no state yet: the moments load fresh
    live = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": torch.ones(2)}
    with caplog.at_level(logging.WARNING, logger="gds_persist"):
        state, info = gds_persist.load_with_info(path, into=live, strict=False)
    assert info.missing_keys == ["['extra']"]
    assert "['optim']['state'][0]['exp_avg']" in info.unexpected_keys
    assert "1 missing key(s)" in caplog.text
    assert torch.equal(model.state_dict()["0.weight"], want_model.state_dict()["0.weight"])
    fresh = state["optim"]["state"][0]["exp_avg"]
    assert torch.equal(fresh, want_opt.state_dict()["state"][0]["exp_avg"])
    assert 0 < info.in_place_bytes < info.payload_bytes
    with pytest.raises(gds_persist.StateMismatchError, match="strict=False"):
        gds_persist.load(path, into=live)  # strict by default


def _awkward() -> dict[str, Any]:
    """One tensor of every awkward kind, contiguous destinations possible for each."""
    g = torch.Generator().manual_seed(3)
    return {"bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
            "cplx": torch.randn(4, dtype=torch.complex64, generator=g),
            "mask": torch.rand(19, generator=g) > 0.5, "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "ids": torch.arange(1000, dtype=torch.int16),
            "big": torch.randn(1 << 20, generator=g)}


def test_every_dtype_and_shape_fills_in_place(tmp_path: Path) -> None:
    want = _awkward()
    gds_persist.save(want, tmp_path / "c")
    live = {k: torch.zeros_like(v) for k, v in want.items()}
    before = _addresses(live)
    state = gds_persist.load(tmp_path / "c", into=live)
    assert _addresses(state) == before
    for k, v in want.items():
        assert live[k].view(torch.uint8).equal(v.view(torch.uint8)) if v.dim() else \
            live[k].reshape(1).view(torch.uint8).equal(v.reshape(1).view(torch.uint8)), k


def test_ties_and_views_in_the_checkpoint(tmp_path: Path) -> None:
    """The shared test state: a tied embedding, a strided view of it, tiny optimizer tensors."""
    gds_persist.save(tasks.make_state(), tmp_path / "c")
    tied = tasks.make_state(seed=9)  # the destination tied and viewed the same way
    assert tasks.check_loaded(gds_persist.load(tmp_path / "c", into=tied)) == []
    untied = tasks.make_state(seed=9)
    model = untied["model"]
    model["lm_head"] = model["lm_head"].clone()  # separate memory: both filled
    model["window"] = torch.zeros(23, 6)  # a contiguous copy of the strided view
    state = gds_persist.load(tmp_path / "c", into=untied)
    want = tasks.make_state()["model"]
    assert state["model"]["lm_head"] is model["lm_head"]
    for k in ("wte", "lm_head", "window"):
        assert torch.equal(model[k], want[k]), k


def test_destinations_tied_where_the_checkpoint_is_not_are_refused(tmp_path: Path) -> None:
    gds_persist.save({"a": torch.ones(8), "b": torch.full((8,), 2.0)}, tmp_path / "c")
    shared = torch.zeros(8)
    with pytest.raises(gds_persist.StateMismatchError, match=r"\['a'\] and \['b'\] share memory"):
        gds_persist.load(tmp_path / "c", into={"a": shared, "b": shared})
    assert torch.equal(shared, torch.zeros(8))


def test_non_contiguous_destinations_and_saved_views(tmp_path: Path) -> None:
    base = torch.arange(120, dtype=torch.float32).reshape(10, 12)
    want = {"t": base.t(), "part": torch.arange(50.0)[10:30], "w": torch.randn(6, 4)}
    gds_persist.save(want, tmp_path / "c")
    live = {"t": torch.zeros(10, 12).t(), "part": torch.zeros(20), "w": torch.zeros(4, 6).t()}
    before = _addresses(live)
    gds_persist.load(tmp_path / "c", into=live)
    assert _addresses(live) == before
    for k in want:
        assert torch.equal(live[k], want[k]), k


def _flip_byte(path: Path) -> None:
    data = sorted(p for p in path.iterdir() if p.name.startswith("data"))[0]
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("layout", ["one tensor per storage", "views of one flat buffer"])
def test_corruption_raises_and_names_what_may_be_partial(tmp_path: Path, layout: str) -> None:
    flat = torch.randn(3 << 16)
    want = ({"a": flat[: 1 << 16], "b": flat[1 << 16 :]} if layout.startswith("views")
            else {"a": torch.randn(1 << 16), "b": torch.randn(2 << 16)})
    gds_persist.save(want, tmp_path / "c", backend="buffered")
    _flip_byte(tmp_path / "c")
    live = {k: torch.zeros(v.shape) for k, v in want.items()}  # separate memory: reads are cut
    with pytest.raises(gds_persist.ChecksumError, match="may hold partial data") as err:
        gds_persist.load(tmp_path / "c", into=live)
    assert "tensor ['a']" in str(err.value)
    assert sorted(err.value.partial_keys) == ["['a']", "['b']"]  # type: ignore[attr-defined]


def test_verify_false_still_fills_in_place(saved: Any) -> None:
    path, want_model, _ = saved
    model, opt = _trained(1)
    gds_persist.load(path, into={"model": model.state_dict(), "optim": opt.state_dict()},
                     verify=False)
    assert torch.equal(model.state_dict()["3.weight"], want_model.state_dict()["3.weight"])


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_incremental_and_compressed_checkpoints_decode_into_place(
        tmp_path: Path, compression: str) -> None:
    model, opt = _trained(0)
    gds_persist.save(_state(model, opt), tmp_path / "s1",
                     options=gds_persist.SaveOptions(content_hash=True))
    with torch.no_grad():
        model[3].weight.add_(1.0)
    gds_persist.save(_state(model, opt), tmp_path / "s2", base=tmp_path / "s1",
                     options=gds_persist.SaveOptions(compression=compression))
    assert gds_persist.read_manifest(tmp_path / "s2").referenced_bytes > 0
    live_model, live_opt = _trained(4)
    live = {"model": live_model.state_dict(), "optim": live_opt.state_dict()}
    before = _addresses(live)
    gds_persist.load(tmp_path / "s2", into=live)
    assert _addresses(live) == before
    for k, v in model.state_dict().items():
        assert torch.equal(live_model.state_dict()[k], v), k


MEMORY_PROBE = textwrap.dedent("""
    import json, sys, torch, gds_persist
    path, mode = sys.argv[1], sys.argv[2]
    live = {f"w{i}": torch.zeros(1 << 22) for i in range(16)}  # 256 MiB, touched
    def hwm():
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
    before = hwm()
    if mode == "into":
        gds_persist.load(path, into=live)
    else:
        state = gds_persist.load(path)
        for k, t in live.items():
            t.copy_(state[k])
    growth = hwm() - before  # before the check below allocates
    ok = all(bool((t == i).all()) for i, t in enumerate(live.values()))
    print(json.dumps({"growth": growth, "ok": ok,
                      "staging": gds_persist.settings.current().staging_bytes}))
""")


def test_host_memory_growth_is_bounded_by_staging(tmp_path: Path) -> None:
    """A fresh process restores 256 MiB: in place it grows by at most the staging ring and a
    margin (64 MiB); a plain load + copy holds the whole state a second time."""
    gds_persist.save({f"w{i}": torch.full((1 << 22,), float(i)) for i in range(16)},
                     tmp_path / "c")
    growth = {}
    for mode in ("into", "plain"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "c"), mode],
                             capture_output=True, text=True, check=True, timeout=120)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["ok"], mode
        growth[mode] = result["growth"]
        staging = result["staging"]
    assert growth["into"] <= staging + (64 << 20), growth
    assert growth["plain"] >= 256 << 20, growth  # the measurement sees a second copy


@pytest.mark.gpu
def test_cuda_destinations_fill_in_place_with_bounded_device_memory(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    want = {f"w{i}": torch.randn(1 << 22, device="cuda") for i in range(8)}
    gds_persist.save(want, tmp_path / "c")
    live = {k: torch.zeros_like(v) for k, v in want.items()}
    before = _addresses(live)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    gds_persist.load(tmp_path / "c", into=live)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - start
    assert growth <= gds_persist.settings.current().staging_bytes, growth
    assert _addresses(live) == before
    for k, v in want.items():
        assert torch.equal(live[k], v), k
