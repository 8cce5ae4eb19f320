"""docs/FORMAT.md stays true: its stand-alone reader reads real checkpoints, its facts match."""

from __future__ import annotations

import collections
import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import gds_persist
from gds_persist import format as fmt
from gds_persist.format import DTYPES, MAX_DEPTH, crc32c
from tests.helpers import flip_byte, raw_bytes

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def _reader() -> dict[str, Any]:
    text = DOC.read_text()
    section = text.split("## A reader without gds_persist", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "the reader's code block is missing from docs/FORMAT.md"
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), str(DOC), "exec"), namespace)  # noqa: S102 - our own doc
    return namespace


def test_documented_reader_reads_a_real_checkpoint(tmp_path: Path) -> None:
    reader = _reader()
    emb = torch.randn(5, 3)
    sd = OrderedDict(
        wte=emb, head=emb, col=emb[:, 1], t=emb.t(),
        ints=torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)[1:, ::2],
        flags=torch.tensor([True, False, True]),
        c=torch.randn(4, dtype=torch.complex128), e=torch.empty(0, 3), s=torch.tensor(7),
        bf=torch.randn(6, dtype=torch.bfloat16),
    )
    tree = {"model": sd, "meta": [1, 2.5, math.inf, None, "x", (True,)], 7: {"é": -0.0}}
    gds_persist.save(tree, tmp_path / "ck")

    got = reader["read_checkpoint"](str(tmp_path / "ck"))
    assert got["meta"][:2] == [1, 2.5] and got["meta"][2] == math.inf
    assert got["meta"][3:5] == [None, "x"] and got["meta"][5] == (True,)
    assert list(got[7]) == ["é"] and math.copysign(1, got[7]["é"]) == -1
    assert list(got["model"]) == list(sd)
    for key, t in sd.items():
        dtype, shape, stride, offset, storage = got["model"][key]
        assert (dtype, shape, stride, offset) == (
            str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset())
        whole_storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        assert storage == raw_bytes(whole_storage), key
        if dtype in reader["NUMPY"]:
            array = reader["as_numpy"](got["model"][key])
            assert array.shape == tuple(t.shape)
            assert array.tobytes() == raw_bytes(t), key
        else:
            whole = torch.frombuffer(bytearray(storage), dtype=t.dtype)
            view = whole.as_strided(t.shape, t.stride(), t.storage_offset())
            assert raw_bytes(view) == raw_bytes(t), key

    flip_byte(tmp_path / "ck" / "data-00000.bin", 5)
    with pytest.raises(AssertionError, match=r"checksum mismatch in data-00000.bin@0"):
        reader["read_checkpoint"](str(tmp_path / "ck"))


def test_documented_reader_reads_extra_leaves(tmp_path: Path) -> None:
    import enum
    import pathlib

    import numpy as np

    class Color(enum.Enum):
        RED = (1, "red")

    reader = _reader()
    state = {"rng": np.random.RandomState(1).get_state(), "a": np.arange(6.0).reshape(2, 3),
             "u": np.array(["x", "yz"]), "s": np.int16(-2), "b": b"\x00\x01",
             "p": pathlib.Path("/data"), "c": Color.RED, "hp": collections.Counter("aab"),
             "w": torch.ones(2)}
    gds_persist.save(state, tmp_path / "ck")
    got = reader["read_checkpoint"](str(tmp_path / "ck"))
    assert got["rng"][0] == "MT19937" and np.array_equal(got["rng"][1], state["rng"][1])
    assert np.array_equal(got["a"], state["a"]) and np.array_equal(got["u"], state["u"])
    assert got["s"] == np.int16(-2) and got["b"] == b"\x00\x01" and got["p"] == "/data"
    assert got["c"] == (1, "red") and got["hp"] == {"a": 2, "b": 1}


def test_documented_facts_match_the_code() -> None:
    text = DOC.read_text()
    assert crc32c(b"123456789") == 0xE3069283 and "0xE3069283" in text
    assert f"`{fmt.SAFE_FILE_NAME.pattern}`" in text
    assert '"version": 1' in text and "(version 1)" in text
    for version in getattr(fmt, "READABLE_VERSIONS", (fmt.FORMAT_VERSION,))[1:]:
        assert f"## Version {version}" in text, f"format version {version} is not documented"
    assert f"always `{fmt.ALIGNMENT}`" in text
    assert f"at most {MAX_DEPTH} containers deep" in text
    dtype_text = text.split("* `dtype`:", 1)[1].split("* `shape`")[0]
    documented = set(re.findall(r"`([a-z0-9_]+)`", dtype_text))
    assert documented - {"torch", "itemsize"} <= set(DTYPES), documented - set(DTYPES)
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "bool", "complex128"} <= documented
