"""``kvikio`` backend: CUDA memory <-> file through KvikIO's ``CuFile`` (cuFile / GPUDirect Storage).

With the nvidia-fs driver, cuFile DMAs between GPU memory and NVMe with no host bounce. Without
it, KvikIO runs in its compatibility mode (POSIX I/O through its own bounce buffers). kvikio and
cupy are imported only when this backend is used; ``pip install 'gds_persist[gpu]'`` provides them.

Note: cuFile reaches full speed with 4096-aligned file offsets and sizes, which the plan guarantees.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import BackendError
from .base import Backend
from .posix import _preallocate

INSTALL_HINT = "install the GPU extra: pip install 'gds_persist[gpu]' (kvikio-cu13, cupy-cuda13x)"


def import_kvikio() -> Any:
    try:
        import kvikio
    except ImportError as e:
        raise BackendError(f"backend 'kvikio' needs kvikio, which is not importable ({e}); {INSTALL_HINT}") from e
    return kvikio


def kvikio_status() -> tuple[bool, str]:
    """Whether the kvikio backend can work here, and why (never raises)."""
    try:
        kvikio = import_kvikio()
    except BackendError as e:
        return False, str(e)
    import torch

    if not torch.cuda.is_available():
        return False, "no usable CUDA device/driver (torch.cuda.is_available() is False)"
    try:
        gds = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as e:  # noqa: BLE001 - any driver probe failure means "no GDS"
        gds, why = False, f"cuFile driver probe failed: {e}"
    else:
        why = "nvidia-fs driver present" if gds else "no nvidia-fs driver"
    mode = "GPUDirect Storage" if gds else "KvikIO compatibility mode (POSIX, no GDS)"
    return True, f"kvikio usable: {mode}; {why}"


class KvikioBackend(Backend):
    name = "kvikio"
    accepts_device = True

    def __init__(self, io_threads: int = 4, task_size: int = 16 << 20):
        self._kvikio = import_kvikio()
        os.environ.setdefault("CUFILE_LOGFILE_PATH", "/tmp/gds_persist-cufile.log")
        try:
            self._kvikio.defaults.set({"num_threads": io_threads, "task_size": task_size})
        except (AttributeError, TypeError):  # older kvikio: per-setting functions
            pass

    def open(self, path: str, *, write: bool, size: int = 0) -> Any:
        if write:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                if size:
                    _preallocate(fd, path, size)
            finally:
                os.close(fd)
            return self._kvikio.CuFile(path, "r+")
        return self._kvikio.CuFile(path, "r")

    def pwrite(self, handle: Any, buf: Any, offset: int) -> None:
        n = _nbytes(buf)
        done = handle.pwrite(buf, n, file_offset=offset).get()
        if done != n:
            raise OSError(f"kvikio wrote {done} of {n} bytes at offset {offset}")

    def pread(self, handle: Any, buf: Any, offset: int) -> int:
        return int(handle.pread(buf, _nbytes(buf), file_offset=offset).get())

    def sync(self, handle: Any) -> None:
        os.fsync(handle.fileno())

    def close(self, handle: Any) -> None:
        handle.close()


def _nbytes(buf: Any) -> int:
    if hasattr(buf, "nbytes"):
        return int(buf.nbytes() if callable(buf.nbytes) else buf.nbytes)
    return memoryview(buf).nbytes
