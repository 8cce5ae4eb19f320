"""Another process working on the same checkpoint paths as a test (tests/test_concurrency.py).

Run as ``python tests/_contender.py``; it imports torch and gds_persist once, then reads one JSON
command per line from stdin and answers one JSON line: ``{"ok": true, ...}`` or ``{"ok": false,
"error": "Type: message"}``. ``hold_*`` commands fork a child that takes the thing and keeps it
(answering with the child's ``pid``) until the test sends ``release`` or SIGKILLs it: a real
process holding real locks on real files, dying for real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gds_persist  # noqa: E402
from gds_persist.transfer import commit  # noqa: E402
from gds_persist.transfer.locks import acquire  # noqa: E402


def state(tag: int, numel: int = 4096) -> dict[str, Any]:
    return {"tag": tag, "w": torch.full((numel,), float(tag)),
            "i": torch.full((7,), tag, dtype=torch.int64)}


def _hold(cmd: dict[str, Any]) -> Any:
    """In the forked child: take what ``cmd`` names; return it (kept alive while sleeping)."""
    op = cmd["op"]
    if op == "hold_temporary":  # a save in progress: owner lock + temporary with a data file
        tmp = commit.make_temporary(cmd["path"])
        Path(tmp.dir, "data-00000.bin").write_bytes(b"x" * 4096)
        return tmp
    if op == "hold_commit_lock":  # a save in the middle of its commit
        return acquire(commit.commit_lock_path(cmd["path"]), timeout_s=5, what="test")
    if op == "hold_stripe":  # a data-parallel rank writing into its data directory
        os.makedirs(cmd["dir"], exist_ok=True)
        lock = acquire(os.path.join(cmd["dir"], ".lock"), shared=True, timeout_s=5, what="test")
        Path(cmd["dir"], "data-r00000-00000.bin").write_bytes(b"x" * 4096)
        return lock
    raise ValueError(f"unknown hold {op}")


HELD: set[int] = set()  # children holding something; killed when the contender exits


def _fork_hold(cmd: dict[str, Any]) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        devnull = os.open(os.devnull, os.O_RDWR)  # not the test's pipes: it waits for their EOF
        for fd in (0, 1):
            os.dup2(devnull, fd)
        try:
            held = _hold(cmd)
            os.write(w, json.dumps({"ok": True}).encode())
            os.close(w)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            while True:  # keeps ``held`` (and its locks) alive until killed
                time.sleep(1)
                assert held is not None
        except BaseException as e:  # noqa: BLE001
            os.write(w, json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(1)
    os.close(w)
    HELD.add(pid)
    with os.fdopen(r) as f:
        reply = json.loads(f.read() or '{"ok": false, "error": "child died"}')
    reply["pid"] = pid
    return reply


def run(cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    commit.USE_RENAME_EXCHANGE = not cmd.get("no_exchange", False)
    if op == "save":
        options = gds_persist.SaveOptions(data_dirs=cmd.get("data_dirs") or None)
        gds_persist.save(state(cmd["tag"], cmd.get("numel", 4096)), cmd["path"], options=options)
    elif op == "ckpt_save":
        with gds_persist.Checkpointer(cmd["root"], keep_last=cmd.get("keep_last", 1)) as ck:
            ck.save(cmd["step"], state(cmd["tag"], cmd.get("numel", 4096)), blocking=True)
    elif op == "rmtree":
        shutil.rmtree(cmd["path"])
    elif op.startswith("hold_"):
        return _fork_hold(cmd)
    elif op == "release":
        os.kill(cmd["pid"], signal.SIGTERM)
        os.waitpid(cmd["pid"], 0)
        HELD.discard(cmd["pid"])
    elif op == "reap":
        _, status = os.waitpid(cmd["pid"], 0)
        HELD.discard(cmd["pid"])
        return {"ok": True, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0}
    else:
        raise ValueError(f"unknown op {op}")
    return {"ok": True}


def main() -> None:
    print(json.dumps({"ok": True, "ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = run(cmd)
        except Exception as e:  # noqa: BLE001 - answered to the test
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    for pid in HELD:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
