"""``warmup``: pay the one-time start-up cost of the save/load path before the first checkpoint
(``docs/TRAINING.md``, "Warm-up"). Steps, each timed, none ever raising: ``cuda`` (the context
and torch's side streams), ``staging`` (the ring the settings describe, pinned, left for the next
save or load to borrow: ``transfer.staging.borrow_ring``), ``backend`` (``choose_backend`` as a
save into ``directory`` would call it, probed in its nearest existing parent: nothing is
created), ``crc_kernel`` and ``hash_kernel`` (the device kernels compiled, loaded and checked on
4 KiB). :class:`gds_persist.Checkpointer` starts it in a background thread
(:class:`BackgroundWarmup`)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import settings
from ..backends import choose_backend
from ..keywords import as_settings, removed_keywords
from ..results import WarmupReport
from .device_kernels import DeviceKernels
from .staging import borrow_ring

log = logging.getLogger("gds_persist")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


@removed_keywords(as_settings("block_bytes", "staging_bytes", "io_threads"))
def warmup(directory: str | os.PathLike[str] | None = None, *, device: Any = None,
           backend: str | None = None) -> WarmupReport:
    """Do the start-up work of the first save/load now; return what each step did and took.

    The staging ring it prepares is the one the settings in force describe
    (:func:`gds_persist.settings.set`).

    Parameters
    ----------
    directory : path, optional
        Where checkpoints will go: the backend probe runs there (skipped when None).
    device : torch.device or int, optional
        The CUDA device the tensors live on (default: see the module doc; ignored without CUDA).
    backend : {"auto", "direct", "buffered", "kvikio"}, optional
        As for :func:`gds_persist.save` (default: the ``backend`` setting).

    Returns
    -------
    WarmupReport
        Each step, what it did and took; a step the machine cannot do is skipped or failed in
        the report, never an error.

    Raises
    ------
    ValueError, BackendError
        Invalid settings, as ``save`` would raise them.
    """
    cfg = settings.current(backend=backend)
    dev, why = default_device() if device is None else (_device(device), NO_CUDA)
    return _run(None if directory is None else os.path.expanduser(os.fspath(directory)), dev,
                why, cfg)


class BackgroundWarmup:
    """:func:`warmup` running in a daemon thread (what a Checkpointer starts). ``report`` is
    None until it is done; :meth:`wait` waits for it (bounded). The settings are
    :func:`warmup`'s."""

    def __init__(self, directory: str | os.PathLike[str] | None, *, backend: str | None = None):
        cfg = settings.current(backend=backend)  # invalid settings raise here, in the caller
        dev, why = default_device()  # the caller's device: a new thread starts on GPU 0
        self.report: WarmupReport | None = None
        self._done = threading.Event()
        path = None if directory is None else os.fspath(directory)
        self._thread = threading.Thread(target=self._main, args=(path, dev, why, cfg),
                                        name="gds_persist-warmup", daemon=True)
        self._thread.start()

    def _main(self, directory: str | None, dev: torch.device | None, why: str,
              cfg: settings.Settings) -> None:
        try:
            self.report = _run(directory, dev, why, cfg)
            log.info("gds_persist: %s", self.report)
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True once the warm-up is done."""
        return self._done.wait(timeout)


def default_device() -> tuple[torch.device | None, str]:
    """The CUDA device the calling thread works on, found without creating a CUDA context,
    or None and why not."""
    if not torch.cuda.is_available():
        return None, NO_CUDA
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()), ""
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0), ""
    return None, (f"{count} GPUs and CUDA not initialised in this thread yet, so which one is "
                  "unknown (call torch.cuda.set_device first, or pass device=)")


def _run(directory: str | None, dev: torch.device | None, why: str,
         cfg: settings.Settings) -> WarmupReport:
    t0 = time.perf_counter()
    report = WarmupReport()
    no_cuda = f"skipped: {why}"
    with contextlib.ExitStack() as on_device:
        if dev is not None:  # this thread's current device, for everything below
            on_device.enter_context(torch.cuda.device(dev))
        _step(report, "cuda", (lambda: _cuda(dev)) if dev is not None else no_cuda)
        _step(report, "staging", lambda: _staging(cfg))
        if directory is None:
            _step(report, "backend", "skipped: no directory given")
        else:
            _step(report, "backend", lambda: _backend(cfg, directory, dev is not None))
        _step(report, "crc_kernel", (lambda: _crc_kernel(dev)) if dev is not None else no_cuda)
        _step(report, "hash_kernel", (lambda: _hash_kernel(dev)) if dev is not None
              else no_cuda)
    report.seconds = time.perf_counter() - t0
    return report


def _step(report: WarmupReport, name: str, run: Callable[[], str] | str) -> None:
    if isinstance(run, str):
        report.steps[name] = (run, 0.0)
        return
    t0 = time.perf_counter()
    try:
        outcome = run()
    except Exception as e:  # noqa: BLE001 - a warm-up never fails the caller; the save will say
        outcome = f"failed: {type(e).__name__}: {e}"
        log.info("gds_persist warm-up step %s %s", name, outcome)
    report.steps[name] = (outcome, time.perf_counter() - t0)


def _device(device: Any) -> torch.device | None:
    d = torch.device(device)
    if d.type != "cuda":
        raise TypeError(f"warmup(device={device!r}) must be a CUDA device")
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


def _cuda(dev: torch.device) -> str:
    torch.empty(1, device=dev)  # the context
    torch.cuda.Stream(device=dev)  # torch's side-stream pool of this device
    torch.cuda.synchronize(dev)
    return f"done: CUDA context and side streams of {dev}"


def _staging(cfg: settings.Settings) -> str:
    count, block = cfg.ring_buffers, cfg.block_bytes
    with borrow_ring(count, block, cfg.io_timeout_s) as ring:
        buffers = [ring.acquire() for _ in range(ring.count)]
        try:
            for b in buffers:
                b.tensor.zero_()  # fault every page in now, not in the first save
        finally:
            for b in buffers:
                ring.release(b)
        pinned = all(b.pinned for b in buffers)
    return (f"done: {count} x {block} B staging ring ({'pinned' if pinned else 'not pinned'}), "
            "kept for the next save/load")


def _backend(cfg: settings.Settings, directory: str, cuda: bool) -> str:
    directory = os.path.abspath(directory)
    while not os.path.lexists(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)  # not there yet: probe where it will be made
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} is not a directory")
    be, reason = choose_backend(cfg.backend, directory, cuda, cfg.io_threads, cfg.block_bytes)
    return f"done: {be.name} ({reason})"


def _hash_kernel(dev: torch.device) -> str:
    from ..format.hashing import content_hash
    from .device_hash import KERNELS, cuda_hash_many

    return _check_kernel(KERNELS, dev, 4097, lambda d: cuda_hash_many([d])[0],
                         lambda d: content_hash(d.cpu().numpy()))


def _crc_kernel(dev: torch.device) -> str:
    from ..format.checksum import crc32c
    from .device_crc import KERNELS, cuda_crc32c

    return _check_kernel(KERNELS, dev, 4096, cuda_crc32c,
                         lambda d: crc32c(d.cpu().numpy()))  # type: ignore[arg-type]


def _check_kernel(kernels: DeviceKernels, dev: torch.device, nbytes: int,
                  on_device: Callable[[torch.Tensor], object],
                  on_host: Callable[[torch.Tensor], object]) -> str:
    """Compile (or load from cupy's cache) and launch a device kernel once, checked against the
    host's result for the same random bytes."""
    ok, why = kernels.status()
    if not ok:
        return f"skipped: {why}"
    # a generator of our own: the warm-up runs beside the caller's code, and drawing from the
    # global one would change the caller's random stream (model init, data order)
    own = torch.Generator(device=dev).manual_seed(0)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=own)
    got, want = on_device(data), on_host(data)
    if got != want:
        return (f"failed: the device {kernels.what} of {nbytes} B was {got!r}, "
                f"the host's {want!r}")
    return f"done: device {kernels.what} kernel compiled/loaded and checked on {dev}"
