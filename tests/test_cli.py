"""The ``gds-persist`` command: ``inspect`` and ``verify``, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.cli import main
from tests.helpers import flip_byte, manifest_doc, rewrite_manifest

REPO = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDS_PERSIST_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "gds_persist", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    emb = torch.randn(4, 3)
    sd = {"model": {"wte": emb, "lm_head": emb, "b": torch.zeros(2, dtype=torch.bfloat16)},
          "optim": {"state": {0: {"exp_avg": torch.ones(5000, dtype=torch.float64)}}},
          "step": 3, "empty": torch.empty(0, 7, dtype=torch.int8)}
    gds_persist.save(sd, tmp_path / "ck", backend="buffered")
    return tmp_path / "ck"


def test_inspect_shows_keys_dtypes_shapes_sizes_backend_and_checksums(ckpt: Path) -> None:
    r = _cli("inspect", str(ckpt), cwd=ckpt.parent)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    body = manifest_doc(ckpt)["body"]
    assert "backend buffered (requested explicitly)" in out
    assert "5 tensors in 4 storages, 1 data files" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]
            if line.strip().startswith("[")}
    assert rows["['model']['wte']"][1:4] == ["float32", "[4,", "3]"]
    assert rows["['model']['b']"][1:4] == ["bfloat16", "[2]", "4"]
    assert rows["['optim']['state'][0]['exp_avg']"][1:4] == ["float64", "[5000]", "40000"]
    assert rows["['empty']"][1:5] == ["int8", "[0,", "7]", "0"]
    for e in body["extents"]:  # every extent's place and checksum is shown
        assert f"data-00000.bin@{e['offset']}+{e['length']} {e['crc32c']:08x}" in out
    tied = [line for line in out.splitlines() if "storage 0:" in line]
    assert len(tied) == 2, "both tied tensors point at storage 0"


def test_verify_ok_then_names_the_corrupted_tensor(ckpt: Path) -> None:
    r = _cli("verify", str(ckpt), cwd=ckpt.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK: {ckpt}: 3 extents in 1 files, 40052 bytes checked")

    (extent,) = [e for e in manifest_doc(ckpt)["body"]["extents"] if e["length"] == 40000]
    flip_byte(ckpt / "data-00000.bin", extent["offset"] + 39999)
    r = _cli("verify", str(ckpt), cwd=ckpt.parent)
    assert r.returncode == 1
    assert r.stdout.startswith(f"FAILED (1 corrupted extents): {ckpt}")
    assert (f"MISMATCH: checksum mismatch in tensor ['optim']['state'][0]['exp_avg']: file "
            f"{ckpt / 'data-00000.bin'}, offset {extent['offset']}") in r.stderr


def test_inspect_json_is_the_manifest_body(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out) == manifest_doc(ckpt)["body"]


def test_verify_with_each_posix_backend(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for backend in ("buffered", "direct"):
        assert main(["verify", "--backend", backend, str(ckpt)]) == 0
        assert capsys.readouterr().out.startswith("OK: ")


def test_cli_errors_exit_2_with_the_reason(ckpt: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert "NotCommittedError" in capsys.readouterr().err
    assert main(["verify", "--backend", "floppy", str(ckpt)]) == 2
    assert "unknown backend 'floppy'; valid backends: auto" in capsys.readouterr().err

    rewrite_manifest(ckpt, lambda body: body["files"][0].update(name="../escape.bin"))
    for command in ("inspect", "verify"):
        assert main([command, str(ckpt)]) == 2
        err = capsys.readouterr().err
        assert f"gds-persist {command}: ManifestError:" in err and "not a plain file name" in err


def test_truncated_file_fails_verify(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(ckpt / "data-00000.bin", 4096)
    assert main(["verify", str(ckpt)]) == 2
    assert "TruncatedError" in capsys.readouterr().err


def test_verify_help_names_every_exit_status_it_returns(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="0"):
        main(["verify", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for line in ("0 every extent read back and matched its checksum", "1 at least one extent did "
                 "not match", "2 the checkpoint could not be read: missing, not committed, a "
                 "data file truncated or missing", "3 the file records no checksums"):
        assert line in flat, flat
    with pytest.raises(SystemExit, match="0"):
        main(["--help"])
    assert "1 on a mismatch, 2 when it cannot" in " ".join(capsys.readouterr().out.split())


def test_inspect_lists_the_leaves_that_are_not_tensors(ckpt: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if "other leaves (not tensors)" in line))
    assert [line.split() for line in lines[at + 1:]] == [["['step']", "3"]]


def test_version() -> None:
    r = _cli("--version", cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"gds-persist {gds_persist.__version__}\n"


def test_a_closed_pipe_ends_the_command_quietly(ckpt: Path) -> None:
    """`gds-persist inspect CKPT | head`: the reader goes before the output is written. A fresh
    interpreter, not a fork: the failure was the interpreter's own last flush of stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDS_PERSIST_")}
    env["PYTHONPATH"] = str(REPO)
    for args in (["inspect", str(ckpt)], ["plan", "--params", "13e9", "--sweep"]):
        with subprocess.Popen([sys.executable, "-m", "gds_persist", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=ckpt.parent) as p:
            assert p.stdout is not None and p.stderr is not None
            p.stdout.close()  # long before the command prints (importing torch takes seconds)
            err = p.stderr.read().decode()
            status = p.wait(timeout=120)
        assert status == 141, err  # what `cat big | head` leaves: 128 + SIGPIPE
        assert err == "", f"{args}: {err}"


def test_a_checkpointer_root_or_its_pointer_names_what_to_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    with gds_persist.Checkpointer(root, keep_last=2) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.ones(2), "step": step})
    assert main(["verify", str(root)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"a Checkpointer root holding 2 committed step(s), step-00000001 to step-00000002: "
            f"load the newest with gds_persist.Checkpointer({str(root)!r}).load(), or name one "
            f"step ({root / 'step-00000002'}") in err
    with pytest.raises(gds_persist.NotACheckpointDirectoryError,
                       match=(f"pointer to its newest step \\(step-00000002\\), not a "
                              f"checkpoint: load that step, {root / 'step-00000002'}, or .*"
                              f"Checkpointer\\('{root}'\\).load\\(\\)")):
        gds_persist.load(root / "latest")
    assert main(["verify", str(root / "step-00000002")]) == 0


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        main([])
    with pytest.raises(SystemExit, match="2"):
        main(["explode", "x"])
    assert "invalid choice" in capsys.readouterr().err


COMMANDS = ["advise", "export", "import", "inspect", "materialize", "plan", "verify"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_discovered_with_its_help(command: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="0"):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gds-persist {command} ")
    assert "``" not in out  # docstrings' reST literals show plain
    with pytest.raises(SystemExit, match="0"):
        main(["--help"])
    listing = capsys.readouterr().out
    assert "``" not in listing
    assert f"    {command} " in listing or f"    {command}\n" in listing  # with its HELP line


def test_the_command_list_is_the_commands_package() -> None:
    import pkgutil

    from gds_persist.cli import commands

    found = sorted(i.name.rstrip("_") for i in pkgutil.iter_modules(commands.__path__))
    assert found == COMMANDS
