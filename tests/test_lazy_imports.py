"""``import gds_persist`` then ``gds_persist.dcp.GdsPersistWriter(path)``, as the README writes
it: the subpackages the docs name resolve as attributes, each importing its heavy dependency
(torch.distributed.checkpoint, Lightning, Accelerate, DeepSpeed) only when first used. Run in a
fresh interpreter so that ``sys.modules`` shows what the import alone pulled in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gds_persist

HEAVY = ("torch.distributed.checkpoint", "lightning", "accelerate", "deepspeed", "kvikio", "cupy")
CODE = """
import json, sys
HEAVY = {heavy!r}
loaded = lambda: sorted(m for m in HEAVY if m in sys.modules)
import gds_persist
seen = {{"import": loaded()}}
writer = gds_persist.dcp.GdsPersistWriter({path!r})
seen["dcp"] = loaded()
io = gds_persist.integrations.lightning.GdsPersistCheckpointIO()
seen["lightning"] = loaded()
seen["accelerate"] = gds_persist.integrations.accelerate.save_state.__module__
seen["before deepspeed"] = loaded()
seen["deepspeed"] = gds_persist.integrations.deepspeed.attach.__module__
seen["cli"] = gds_persist.cli.main.__module__
print(json.dumps(seen))
"""


def test_subpackages_resolve_after_import_and_load_lazily(tmp_path: Path) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CODE.format(heavy=HEAVY, path=str(tmp_path / "ck"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["import"] == []
    assert seen["dcp"] == ["torch.distributed.checkpoint"]
    assert "lightning" in seen["lightning"] and "accelerate" not in seen["lightning"]
    assert seen["accelerate"] == "gds_persist.integrations.accelerate"
    assert "deepspeed" not in seen["before deepspeed"]
    assert seen["deepspeed"] == "gds_persist.integrations.deepspeed"
    assert seen["cli"] == "gds_persist.cli"


def test_unknown_attributes_still_raise_and_dir_lists_the_lazy_ones() -> None:
    for name in gds_persist.LAZY_SUBMODULES:
        assert name in dir(gds_persist)
    assert "lightning" in dir(gds_persist.integrations)
    with pytest.raises(AttributeError, match=r"^module 'gds_persist' has no attribute 'nope'$"):
        gds_persist.nope  # noqa: B018
