"""``kvikio`` backend: CUDA memory <-> file through KvikIO's ``CuFile`` (cuFile, GPUDirect Storage).

With the nvidia-fs driver, cuFile DMAs between GPU memory and NVMe with no host bounce. Without
it, cuFile (or KvikIO itself, when it prefers its compatibility mode) does POSIX I/O through
bounce buffers. kvikio and cupy are imported only when this backend is used;
``pip install 'gds_persist[gpu]'`` provides them.

What this backend guarantees:

* **One handle per file per save/load.** :meth:`open` opens a ``CuFile`` and one descriptor of
  our own (O_DIRECT where the filesystem takes it) for fsync, host buffers and fallbacks.
* **KvikIO's settings from ours.** ``num_threads`` = ``io_threads`` and ``task_size`` =
  ``block_bytes``, through ``kvikio.defaults.set`` (process-wide in KvikIO, changed only when
  they differ, since a new thread count rebuilds KvikIO's pool).
* **Never a crash on a cuFile failure.** :meth:`probe` (called by ``choose_backend``) tries one
  4 KiB cuFile transfer in the target directory first; if it fails, the save/load uses the
  ``direct`` (or ``buffered``) backend and the reason is recorded. If cuFile fails later, in the
  middle of a save or load (buffer or handle registration refused, any cuFile error), the
  backend switches to POSIX I/O through a pinned bounce buffer for the rest of it, records the
  reason in :attr:`fallback_reason` (it ends up in the save's ``info.reason`` and the manifest)
  and logs a warning. Bytes on disk are identical either way.
* **Host buffers** (the staging ring, for CPU tensors in a mixed state dict or after a
  fallback) go straight to our own descriptor, exactly as the ``direct`` backend writes them.
* **No cufile.log in the working directory.** libcufile writes its log into the current
  directory unless ``CUFILE_LOGFILE_PATH`` is set when it loads; :func:`import_kvikio` points it
  at ``$TMPDIR/gds_persist-cufile-<uid>.log`` unless the user already chose a path.

A decision, documented: ``backend="kvikio"`` where kvikio is importable but cannot work (no CUDA
driver, cuFile refuses the directory) falls back with the reason in ``info.reason``; where
kvikio is not importable at all it raises :class:`BackendError` naming the extra to install.

SAFETY: cuFile does not see torch's CUDA streams. Before the first device transfer of each
handle, the current stream of the tensor's device is synchronized, so producers of the bytes
(save) and earlier users of a reused allocation (load) have finished.

Note: cuFile reaches full speed with 4096-aligned file offsets and sizes, which the plan guarantees.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendError
from ..format import ALIGNMENT, align_up
from .auto import KvikioFacts
from .base import Backend
from .buffers import AlignedBuffer
from .posix import _O_DIRECT, open_fd, pread_all, pwrite_all, supports_o_direct, zero_pad_end

log = logging.getLogger("gds_persist")

INSTALL_HINT = "install the GPU extra: pip install 'gds_persist[gpu]' (kvikio-cu13, cupy-cuda13x)"
CUFILE_LOG_ENV = "CUFILE_LOGFILE_PATH"
ALIGN = ALIGNMENT  # cuFile is fastest with 4096-aligned offsets and sizes
_COMPAT_NAMES = {0: "OFF", 1: "ON", 2: "AUTO"}


def cufile_log_path() -> str:
    """Where libcufile's log goes when the user has not chosen (never the working directory)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"gds_persist-cufile-{uid}.log")


def route_cufile_log() -> str:
    """Point libcufile's log away from the working directory (before libcufile loads)."""
    if not os.environ.get(CUFILE_LOG_ENV):
        os.environ[CUFILE_LOG_ENV] = cufile_log_path()
    return os.environ[CUFILE_LOG_ENV]


def import_kvikio() -> Any:
    route_cufile_log()
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except ImportError as e:
        raise BackendError(
            f"backend 'kvikio' needs kvikio, which is not importable ({e}); {INSTALL_HINT}"
        ) from e
    return kvikio


def compat_mode_name(kvikio: Any) -> str:
    value = kvikio.defaults.get("compat_mode")
    return _COMPAT_NAMES.get(int(value), str(value))


def gds_mode(kvikio: Any) -> tuple[bool, str]:
    """``(gds, description)``: whether cuFile will use GPUDirect Storage, and why (or why not).

    Call only where a CUDA driver exists: without one, libcufile's driver probe can hang.
    """
    compat = compat_mode_name(kvikio)
    if compat == "ON":
        return False, "KvikIO compatibility mode forced (KVIKIO_COMPAT_MODE=ON): POSIX, no cuFile"
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return False, ("KvikIO compatibility mode (KvikIO found no usable libcufile/GDS "
                           "setup, e.g. /run/udev unreadable): POSIX, no cuFile")
    except Exception:  # noqa: BLE001 - older kvikio without the query
        pass
    try:
        gds = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as e:  # noqa: BLE001 - any driver probe failure means "no GDS"
        return False, f"cuFile compatibility mode (cuFile driver probe failed: {e})"
    if gds:
        return True, "GPUDirect Storage (cuFile with the nvidia-fs driver)"
    why = ("nvidia-fs kernel module not loaded" if not os.path.exists("/proc/driver/nvidia-fs")
           else "cuFile reports GDS unavailable")
    return False, f"cuFile compatibility mode (POSIX inside cuFile; {why})"


def kvikio_facts() -> KvikioFacts:
    """Whether the kvikio backend can work here, whether cuFile runs in GDS mode, and why
    (never raises; what ``backend="auto"`` decides from)."""
    try:
        kvikio = import_kvikio()
    except BackendError as e:
        return KvikioFacts(False, False, str(e))
    import torch

    if not torch.cuda.is_available():
        return KvikioFacts(False, False,
                           "no usable CUDA device/driver (torch.cuda.is_available() is False)")
    try:
        gds, mode = gds_mode(kvikio)
    except Exception as e:  # noqa: BLE001
        gds, mode = False, f"mode unknown ({e})"
    return KvikioFacts(True, gds, f"kvikio usable: {mode}")


def kvikio_status() -> tuple[bool, str]:
    """Whether the kvikio backend can work here, and why (never raises)."""
    facts = kvikio_facts()
    return facts.usable, facts.why


def _is_device(buf: Any) -> bool:
    return bool(getattr(buf, "is_cuda", False))


@dataclass
class KvikioHandle:
    path: str
    fd: int  # ours: fsync, host buffers, fallback I/O
    direct: bool  # fd has O_DIRECT (aligned transfers only)
    cufile: Any = None  # kvikio.CuFile; None when cuFile could not open the file
    synced: set = field(default_factory=set)  # devices whose current stream was synchronized
    device_end: int = 0  # end of the furthest cuFile write (exact lengths, no padding)


class KvikioBackend(Backend):
    name = "kvikio"
    accepts_device = True  # per instance: False once cuFile failed (the writer then stages)

    def __init__(self, io_threads: int = 4, task_size: int = 16 << 20):
        self._kvikio = import_kvikio()
        self.task_size = task_size
        self.fallback_reason: str | None = None
        self.settings_note = self._configure(io_threads, task_size)
        self._lock = threading.Lock()
        self._bounce: Any = None  # AlignedBuffer, created on the first fallback transfer
        self._o_direct: dict[str, bool] = {}

    # -- settings and probing -------------------------------------------------------------------

    def _configure(self, io_threads: int, task_size: int) -> str:
        defaults = self._kvikio.defaults
        wanted = {"num_threads": io_threads, "task_size": task_size}
        try:
            changes = {k: v for k, v in wanted.items() if defaults.get(k) != v}
            if changes:
                defaults.set(changes)
        except Exception as e:  # noqa: BLE001 - a kvikio without these settings still works
            return f"kvikio settings not applied ({e})"
        return f"kvikio num_threads={io_threads}, task_size={task_size}"

    def probe(self, directory: str) -> tuple[bool, str]:
        """One real 4 KiB cuFile transfer in ``directory`` (a read of an existing file there,
        else a write to a probe file that is removed). ``(ok, why)``; never raises."""
        import torch

        cuda = torch.cuda.is_available()
        try:
            compat = compat_mode_name(self._kvikio)
        except Exception as e:  # noqa: BLE001
            return False, f"kvikio defaults unreadable ({e})"
        if not cuda and compat == "OFF":
            return False, ("no usable CUDA driver, and KVIKIO_COMPAT_MODE=OFF makes libcufile "
                           "initialise, which can hang without one; not calling cuFile")
        try:
            if cuda:
                buf: Any = torch.zeros(ALIGN, dtype=torch.uint8, device="cuda")
                torch.cuda.current_stream().synchronize()
            else:
                import numpy as np

                buf = np.zeros(ALIGN, dtype=np.uint8)  # still a real kvikio call; fails for real
            existing = _some_file(directory)
            if existing is not None:
                size = min(ALIGN, os.path.getsize(existing))
                with self._kvikio.CuFile(existing, "r") as f:
                    got = f.pread(buf, size, file_offset=0).get()
                if got != size:
                    return False, f"cuFile read probe of {existing} returned {got} of {size} bytes"
            else:
                probe = os.path.join(directory, f".kvikio_probe-{uuid.uuid4().hex}")
                try:
                    with open(probe, "wb") as f:
                        f.truncate(ALIGN)
                    with self._kvikio.CuFile(probe, "r+") as f:
                        got = f.pwrite(buf, ALIGN, file_offset=0).get()
                finally:
                    if os.path.exists(probe):
                        os.unlink(probe)
                if got != ALIGN:
                    return False, f"cuFile write probe wrote {got} of {ALIGN} bytes"
        except Exception as e:  # noqa: BLE001 - any cuFile/KvikIO/CUDA failure: not usable
            return False, f"a 4 KiB cuFile probe in {directory} failed ({type(e).__name__}: {e})"
        if not cuda:  # cannot happen with a real kvikio, but never claim success without CUDA
            return False, "no usable CUDA device/driver"
        _, mode = gds_mode(self._kvikio)
        return True, f"{mode}; {self.settings_note}"

    # -- the Backend interface -----------------------------------------------------------------

    def open(self, path: str, *, write: bool, size: int = 0,
             create: bool = True) -> KvikioHandle:
        # realpath: a held file is read as /proc/self/fd/N (gds_persist.transfer.opened); its
        # O_DIRECT support is that of the directory it lives in
        directory = os.path.dirname(os.path.realpath(path))
        direct = self._o_direct.get(directory)
        if direct is None:
            direct = self._o_direct[directory] = supports_o_direct(directory)[0]
        fd = open_fd(path, write, size, _O_DIRECT if direct else 0, create)
        handle = KvikioHandle(path, fd, direct)
        if self.fallback_reason is None:
            try:
                handle.cufile = self._kvikio.CuFile(path, "r+" if write else "r")
            except Exception as e:  # noqa: BLE001 - e.g. cuFileHandleRegister refused
                self._fail(f"cuFile could not open {path} ({type(e).__name__}: {e})")
        return handle

    def pwrite(self, handle: KvikioHandle, buf: Any, offset: int) -> None:
        if not _is_device(buf):
            pwrite_all(handle.fd, memoryview(buf).cast("B"), offset)
            return
        n = buf.numel()
        if handle.cufile is not None and self.fallback_reason is None:
            self._sync_device(handle, buf)
            try:
                done = handle.cufile.pwrite(buf, n, file_offset=offset).get()
                if done == n:
                    with self._lock:
                        handle.device_end = max(handle.device_end, offset + n)
                    return
                raise OSError(f"cuFile wrote {done} of {n} bytes")
            except Exception as e:  # noqa: BLE001 - any cuFile failure: POSIX from here on
                self._fail(f"cuFile write of {n} bytes at offset {offset} of {handle.path} "
                           f"failed ({type(e).__name__}: {e})")
        self.bounce_write(handle, buf, offset)

    def pread(self, handle: KvikioHandle, buf: Any, offset: int) -> int:
        if not _is_device(buf):
            return pread_all(handle.fd, memoryview(buf).cast("B"), offset)
        n = buf.numel()
        if handle.cufile is not None and self.fallback_reason is None:
            self._sync_device(handle, buf)
            try:
                return int(handle.cufile.pread(buf, n, file_offset=offset).get())
            except Exception as e:  # noqa: BLE001
                self._fail(f"cuFile read of {n} bytes at offset {offset} of {handle.path} "
                           f"failed ({type(e).__name__}: {e})")
        return self.bounce_read(handle, buf, offset)

    def sync(self, handle: KvikioHandle) -> None:
        # cuFile wrote exact lengths: the alignment padding after the last one is not in the
        # file where its size was not reserved (tmpfs), and the manifest records it
        if handle.device_end:
            zero_pad_end(handle.path, handle.fd, handle.direct, handle.device_end, ALIGN)
        os.fsync(handle.fd)

    def close(self, handle: KvikioHandle) -> None:
        try:
            if handle.cufile is not None:
                handle.cufile.close()
                handle.cufile = None
        except Exception as e:  # noqa: BLE001 - closing must not mask the real outcome
            log.warning("gds_persist: closing the cuFile handle of %s failed: %s", handle.path, e)
        finally:
            os.close(handle.fd)
            self._free_bounce()

    # -- fallback --------------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.fallback_reason is None:
                target = "direct" if self._o_direct and all(self._o_direct.values()) else "POSIX"
                self.fallback_reason = (f"kvikio fell back to {target} I/O at run time: {why}")
                self.accepts_device = False  # the writer/reader stages the remaining files
                log.warning("gds_persist: %s", self.fallback_reason)

    def _sync_device(self, handle: KvikioHandle, buf: Any) -> None:
        device = buf.device
        if device not in handle.synced:
            import torch

            torch.cuda.current_stream(device).synchronize()
            handle.synced.add(device)

    def _bounce_buffer(self) -> Any:
        if self._bounce is None:
            self._bounce = AlignedBuffer(max(ALIGN, align_up(self.task_size)))
        return self._bounce

    def _free_bounce(self) -> None:
        with self._lock:
            if self._bounce is not None:
                self._bounce.close()
                self._bounce = None

    def bounce_write(self, handle: KvikioHandle, tensor: Any, offset: int) -> None:
        """Write a tensor's bytes (any device) at ``offset`` through the aligned (pinned) bounce
        buffer and our descriptor. With O_DIRECT the last piece is zero-padded to 4096 bytes:
        the plan puts nothing else before the next aligned offset (the gap is zeros anyway)."""
        n = tensor.numel()
        with self._lock:
            bounce = self._bounce_buffer()
            step = bounce.nbytes
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                length = hi - lo
                bounce.tensor[:length].copy_(tensor[lo:hi])
                if handle.direct:
                    padded = align_up(length)
                    bounce.tensor[length:padded].zero_()
                    length = padded
                pwrite_all(handle.fd, bounce.view[:length], offset + lo)
            handle.device_end = max(handle.device_end, offset + n)  # unpadded without O_DIRECT

    def bounce_read(self, handle: KvikioHandle, tensor: Any, offset: int) -> int:
        """Read ``tensor.numel()`` bytes at ``offset`` into a tensor (any device) through the
        bounce buffer; returns the bytes read (short only at the end of the file)."""
        n = tensor.numel()
        total = 0
        with self._lock:
            bounce = self._bounce_buffer()
            step = bounce.nbytes
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                want = align_up(hi - lo) if handle.direct else hi - lo
                got = min(pread_all(handle.fd, bounce.view[:want], offset + lo), hi - lo)
                tensor[lo : lo + got].copy_(bounce.tensor[:got])
                total += got
                if got < hi - lo:
                    break
        return total


def _some_file(directory: str) -> str | None:
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_size > 0:
                    return entry.path
    except OSError:
        pass
    return None
