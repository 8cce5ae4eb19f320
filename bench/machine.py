"""Facts about the machine for the benchmark header, and page-cache control.

Every probe here is guarded: on a machine without a GPU, NVML, kvikio or a block device behind
the directory, the answer says so instead of raising.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cores() -> dict[str, int]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return {"logical": os.cpu_count() or 0, "usable": usable or (os.cpu_count() or 0)}


def memory_bytes() -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def mount_of(path: str) -> dict[str, str]:
    """Mount point, filesystem type and source device of ``path`` (from /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best: dict[str, str] = {}
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.get("mount_point", "")):
            best = {"mount_point": point, "fstype": rest[0], "source": rest[1]}
    return best or {"mount_point": "?", "fstype": "unknown", "source": "unknown"}


def block_device(path: str) -> dict[str, Any]:
    """Logical/physical block size and name of the block device holding ``path``, if any."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    out: dict[str, Any] = {"dev": f"{major}:{minor}", "statvfs_block": os.statvfs(path).f_bsize}
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(sys_dev):
        out["note"] = "no block device behind this filesystem (overlay, tmpfs or network?)"
        return out
    node = os.path.realpath(sys_dev)
    out["name"] = os.path.basename(node)
    queue = os.path.join(node, "queue")
    if not os.path.isdir(queue):  # a partition: the queue belongs to the whole disk
        queue = os.path.join(os.path.dirname(node), "queue")
        out["disk"] = os.path.basename(os.path.dirname(node))
    for key in ("logical_block_size", "physical_block_size", "rotational", "scheduler",
                "max_sectors_kb", "nr_requests"):
        value = _read(os.path.join(queue, key))
        if value is not None:
            out[key] = int(value) if value.isdigit() else value
    model = _read(os.path.join(os.path.dirname(queue), "device", "model"))
    if model:
        out["model"] = model
    return out


def o_direct(path: str) -> tuple[bool, str]:
    try:
        from gds_persist.backends import supports_o_direct

        return supports_o_direct(path)
    except Exception as e:  # noqa: BLE001 - the header never raises
        return False, f"O_DIRECT probe failed: {e}"


def gpu_info() -> dict[str, Any]:
    """GPU, driver and GDS status, or why there is none. Never raises."""
    info: dict[str, Any] = {"available": False}
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["available"] = True
            info["devices"] = [torch.cuda.get_device_name(i)
                               for i in range(torch.cuda.device_count())]
        else:
            info["why_not"] = "torch.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001
        info["why_not"] = f"torch.cuda probe failed: {e}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound on CPU machines
        info["nvml"] = f"no NVML ({type(e).__name__})"
    try:
        from gds_persist.parallel.topology import topology

        topo = topology()  # never raises
        info["topology"] = topo.as_dict()
        if topo.gpus:
            g = topo.gpus[0]
            info["pcie"] = g.pcie
            info["numa_node"] = g.numa_node
    except Exception as e:  # noqa: BLE001
        info["topology"] = {"error": str(e)}
    if info["available"]:
        try:
            from gds_persist.backends.kvikio_backend import kvikio_status

            usable, why = kvikio_status()
            info["kvikio"] = why
            info["kvikio_usable"] = usable
        except Exception as e:  # noqa: BLE001
            info["kvikio"] = f"kvikio probe failed: {e}"
            info["kvikio_usable"] = False
    return info


def gpu_line(info: dict[str, Any]) -> str:
    if not info.get("available"):
        extra = "; ".join(str(info[k]) for k in ("why_not", "nvml") if k in info)
        return f"no GPU ({extra})" if extra else "no GPU"
    parts = [", ".join(info.get("devices", [])),
             f"driver {info.get('driver', '?')}", f"CUDA {info.get('torch_cuda')}",
             str(info.get("pcie", "PCIe unknown")), f"NUMA node {info.get('numa_node')}",
             str(info.get("kvikio", "kvikio status unknown"))]
    return "; ".join(parts)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0], "kernel": platform.release()}
    for name in ("torch", "gds_persist", "safetensors", "numpy", "kvikio"):
        mod = sys.modules.get(name)
        if mod is None and name != "kvikio":  # kvikio only if already imported by a probe
            try:
                mod = __import__(name)
            except Exception:  # noqa: BLE001
                mod = None
        out[name] = getattr(mod, "__version__", None) if mod else None
    try:
        import gds_persist

        out["gds_persist_path"] = os.path.dirname(gds_persist.__file__)
        out["gds_persist_git"] = git_revision(out["gds_persist_path"])
        from gds_persist.format.checksum import IMPLEMENTATION

        out["host_crc32c"] = IMPLEMENTATION
    except Exception:  # noqa: BLE001
        pass
    return out


def git_revision(path: str) -> str | None:
    """Short commit of the git checkout holding ``path`` (``+dirty`` if modified), or None."""
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


CACHE_MODES = ("auto", "global", "per-file")


def drop_page_cache(paths: list[str], mode: str = "auto") -> tuple[str, str]:
    """Evict the page cache before a cold load. Returns (how, detail).

    ``global`` (``auto`` as root): ``sync; echo 3 > /proc/sys/vm/drop_caches``, the whole cache
    (library code too, as after a reboot). ``per-file`` (``auto`` otherwise, no root needed):
    ``posix_fadvise(DONTNEED)`` on every file under ``paths``, which drops their clean, unmapped
    pages (the data was fsynced and nothing maps it) and leaves the rest of the cache warm, as
    for a training process that reloads a checkpoint.
    """
    if mode not in CACHE_MODES:
        raise ValueError(f"cache mode {mode!r}: choose one of {', '.join(CACHE_MODES)}")
    why = ""
    if mode == "global" or (mode == "auto" and is_root()):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches", "sync; echo 3 > /proc/sys/vm/drop_caches before each load"
        except OSError as e:
            why = f"drop_caches refused ({e.strerror}); "
    elif mode == "auto":
        why = "not root; "
    if not hasattr(os, "posix_fadvise"):
        return "none", f"{why}no posix_fadvise: loads may be served from the page cache"
    for f in _files(paths):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return "fadvise", f"{why}posix_fadvise(DONTNEED) on the checkpoint's files before each load"


def resident_bytes(paths: list[str]) -> int | None:
    """Bytes of the files under ``paths`` now in the page cache (``cachestat``, else
    ``mincore``), None if unknown."""
    from gds_persist.backends.residency import resident_bytes as held

    got = held(_files(paths))
    return None if got is None else got[0]


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                out += [os.path.join(root, n) for n in names]
        elif os.path.exists(p):
            out.append(p)
    return out


def describe(directory: str) -> dict[str, Any]:
    """Everything the header shows, as plain data."""
    ok, why = o_direct(directory)
    return {
        "cpu": cpu_model(),
        "cores": cores(),
        "memory_bytes": memory_bytes(),
        "hostname": platform.node(),
        "directory": os.path.realpath(directory),
        "filesystem": mount_of(directory),
        "block_device": block_device(directory),
        "o_direct": {"supported": ok, "detail": why},
        "gpu": gpu_info(),
        "versions": versions(),
        "root": is_root(),
    }
