"""``backend="auto"``: the rule (a pure function of a described environment) for every case, and
``choose_backend`` gathering the real facts of this machine."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist import settings
from gds_persist.backends import choose_backend, supports_o_direct
from gds_persist.backends.auto import MEASURED, AutoEnvironment, KvikioFacts, decide

GDS = KvikioFacts(True, True, "kvikio usable: GPUDirect Storage (cuFile with the nvidia-fs driver)")
COMPAT = KvikioFacts(True, False, "kvikio usable: KvikIO compatibility mode (..): POSIX, no cuFile")
NO_DRIVER = KvikioFacts(False, False, "no usable CUDA device/driver")
NOT_INSTALLED = KvikioFacts(False, False, "backend 'kvikio' needs kvikio, which is not importable")
FACTS = {"gds": GDS, "compat": COMPAT, "no driver": NO_DRIVER, "not installed": NOT_INSTALLED,
         "not examined": None}


def _expected(wants_device: bool, o_direct: bool, facts: str, policy: str) -> str:
    """The rule, written out independently of decide()."""
    kvikio = (wants_device and policy != "never" and facts in ("gds", "compat")
              and (facts == "gds" or policy == "always"))
    return "kvikio" if kvikio else "direct" if o_direct else "buffered"


@pytest.mark.parametrize("wants_device, o_direct, facts, policy", list(itertools.product(
    (False, True), (True, False), FACTS, settings.AUTO_KVIKIO)))
def test_every_case(wants_device: bool, o_direct: bool, facts: str, policy: str) -> None:
    why = "/ck accepts O_DIRECT" if o_direct else "open(O_DIRECT) failed on /ck: Invalid argument"
    env = AutoEnvironment(wants_device, o_direct, why, FACTS[facts], policy)
    name, reason = decide(env)
    assert name == _expected(wants_device, o_direct, facts, policy)
    assert reason.startswith("auto: ")
    if name != "kvikio":
        assert why in reason  # the O_DIRECT probe's own words
        assert "kvikio not used (" in reason
    if not wants_device:
        assert reason.endswith("kvikio not used (no CUDA tensors)")


def test_gds_mode_takes_kvikio_and_says_so() -> None:
    name, reason = decide(AutoEnvironment(True, True, "ok", GDS))
    assert name == "kvikio"
    assert reason == f"auto: CUDA tensors and cuFile in GPUDirect Storage mode ({GDS.why})"


def test_compatibility_mode_takes_direct_quoting_the_measurement() -> None:
    name, reason = decide(AutoEnvironment(True, True, "/ck accepts O_DIRECT", COMPAT))
    assert name == "direct"
    assert COMPAT.why in reason and MEASURED in reason
    assert 'docs/GPU.md, "What happens to CUDA tensors"' in reason
    assert "direct 2.34 vs kvikio 1.59 GB/s" in reason
    assert "GDS_PERSIST_AUTO_KVIKIO=always" in reason  # how to override after a measurement


def test_the_measurement_is_in_the_cited_doc_section_and_its_file() -> None:
    repo = Path(__file__).resolve().parent.parent
    doc, section = re.fullmatch(r'(docs/\S+), "([^"]+)"', MEASURED.split(":")[0]).groups()
    text = (repo / doc).read_text()
    body = text[text.index(f"## {section}\n"):]
    body = body[:body.index("\n## ", 1)]
    assert "1.59 against 2.34 GB/s" in body
    text = (repo / re.search(r"`(bench/results/\S+)`", body)[1]).read_text()
    assert "gds_persist direct                 2.34" in text
    assert "gds_persist kvikio (cuFile com     1.59" in text


def test_always_and_never() -> None:
    assert decide(AutoEnvironment(True, True, "ok", COMPAT, "always"))[0] == "kvikio"
    assert "auto_kvikio='always'" in decide(AutoEnvironment(True, True, "ok", COMPAT, "always"))[1]
    name, reason = decide(AutoEnvironment(True, True, "ok", GDS, "never"))
    assert name == "direct" and "auto_kvikio='never'" in reason
    # unusable kvikio is not taken even when asked to always
    name, reason = decide(AutoEnvironment(True, False, "no", NO_DRIVER, "always"))
    assert name == "buffered" and "no usable CUDA device/driver" in reason


# --- choose_backend with the real facts of this machine ------------------------------------------

def _o_direct(tmp_path: Path) -> str:
    return "direct" if supports_o_direct(str(tmp_path))[0] else "buffered"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA facts; this has CUDA")
def test_choose_backend_for_cuda_tensors_without_a_driver(tmp_path: Path) -> None:
    be, reason = choose_backend("auto", str(tmp_path), True)
    assert be.name == _o_direct(tmp_path)
    assert reason.startswith("auto: ") and "kvikio not used (" in reason
    assert "CUDA" in reason or "not importable" in reason


def test_choose_backend_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setenv("GDS_PERSIST_AUTO_KVIKIO", "never")
    be, reason = choose_backend("auto", str(tmp_path), True)
    assert be.name == _o_direct(tmp_path) and "auto_kvikio='never'" in reason
    with settings.set(auto_kvikio="always"):  # set() beats the environment; the argument beats it
        be, reason = choose_backend("auto", str(tmp_path), True, auto_kvikio="never")
        assert "auto_kvikio='never'" in reason


@pytest.mark.gpu
def test_auto_on_a_gpu_takes_kvikio_only_in_gds_mode(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    pytest.importorskip("kvikio", reason="kvikio not importable; install the gpu extra")
    from gds_persist.backends.kvikio_backend import kvikio_facts

    facts = kvikio_facts()
    assert facts.usable, facts.why
    info = gds_persist.save({"w": torch.randn(4096, device="cuda")}, tmp_path / "ck")
    if facts.gds:
        assert info.backend == "kvikio" and "GPUDirect Storage mode" in info.reason
    else:
        assert info.backend == _o_direct(tmp_path), info.reason
        assert MEASURED in info.reason
    with settings.set(auto_kvikio="always"):
        info = gds_persist.save({"w": torch.randn(4096, device="cuda")}, tmp_path / "ck2")
    assert info.backend == "kvikio", info.reason
