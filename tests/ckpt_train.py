"""A deterministic tiny training run that checkpoints every step.

Imported by the Checkpointer tests (the uninterrupted reference run, resumes); run as a script it
is the training subprocess the crash test kills::

    python tests/ckpt_train.py ROOT TOTAL_STEPS [fence|snapshot|snapshot+process]

It resumes from the latest checkpoint under ROOT, prints ``started <step> <pid>`` and trains to
TOTAL_STEPS, saving after every optimizer step (and printing ``step <k>`` after each save call).
One intra-op thread, so results are bit-exact across processes.

``python tests/ckpt_train.py --zygote`` imports torch once, then for every line
``ROOT TOTAL MODE`` read from stdin forks a training process as above (a fresh process would spend
seconds importing torch on a loaded 2-core machine) and, when it has exited, prints
``exit <pid> <wait status>``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

BATCH, FEATURES, HIDDEN, OUT = 8, 16, 32, 4


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUT, generator=g)
    opt.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def restore(model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> int:
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return int(sd["step"])


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int, ckpt: Any = None,
          on_step: Callable[[int], None] | None = None) -> None:
    """Steps ``start+1 .. stop``; checkpoint ``k`` holds the state after ``k`` updates."""
    for step in range(start + 1, stop + 1):
        train_step(model, opt, step)
        if ckpt is not None:
            ckpt.save(step, state(model, opt, step))
        if on_step is not None:
            on_step(step)


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def reference(total: int) -> list[dict[str, Any]]:
    """Deep copies of the state after 0..total steps of the uninterrupted run."""
    with one_thread():
        model, opt = make()
        states = [clone(state(model, opt, 0))]
        train(model, opt, 0, total, on_step=lambda s: states.append(clone(state(model, opt, s))))
    return states


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Same structure, same leaves, tensors with the same dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8),
                           b.detach().reshape(-1).view(torch.uint8)), f"{where}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {b!r:.200}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} vs {b!r}"


def say(line: str) -> None:
    """One write(2) per line: a process killed mid-print must not leave half a line."""
    os.write(1, f"{line}\n".encode())


def main(root: str, total: int, mode: str = "fence") -> None:
    from gds_persist import Checkpointer

    mode, _, writer = mode.partition("+")  # e.g. "snapshot+process"
    writer = writer or "thread"
    with one_thread(), Checkpointer(root, keep_last=2, mode=mode, writer=writer) as ckpt:
        model, opt = make()
        ckpt.guard(opt)
        start = restore(model, opt, ckpt.load()) if ckpt.latest_step() is not None else 0
        say(f"started {start} {os.getpid()}")
        train(model, opt, start, total, ckpt, on_step=lambda s: say(f"step {s}"))


def zygote() -> None:
    import gds_persist  # noqa: F401 - imported before forking, like torch

    torch.set_num_threads(1)
    with one_thread():  # warm the lazy imports of the first optimizer step
        model, opt = make()
        train_step(model, opt, 1)
    assert len(os.listdir("/proc/self/task")) == 1, "fork only from a single-threaded process"
    say("ready")
    for line in sys.stdin:
        root, total, mode = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                main(root, int(total), mode)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        say(f"exit {pid} {status}")


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote()
    else:
        main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
