"""What one process knows about where it runs: its node, and its GPU's CPU affinity (via NVML).

Used to place writers (``gds_persist.schedule.choose_writers``). NVML is optional: where it is not
usable (no driver, no ``pynvml``, CPU-only training) the probe says why and the scheduler falls
back to spreading writers evenly by local rank; nothing fails.
"""

from __future__ import annotations

import os
import socket

NODE_ENV = "GDS_PERSIST_NODE"  # overrides the hostname as node identity (containers, tests)


def node_name() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


def _pci_bus_id(device: int) -> str | None:
    import torch

    props = torch.cuda.get_device_properties(device)
    if not hasattr(props, "pci_bus_id"):
        return None
    domain, bus = getattr(props, "pci_domain_id", 0), props.pci_bus_id
    return f"{domain:08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


_probed: dict[int, tuple[str | None, str]] = {}


def gpu_affinity() -> tuple[str | None, str]:
    """``(affinity group, how it was found)`` for this process's current CUDA device.

    The group is the GPU's NUMA node (or its CPU-affinity mask) from NVML; ``None`` when unknown,
    with the reason. Never raises. Probed once per process and device.
    """
    try:
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    except Exception:  # noqa: BLE001
        device = -1
    if device not in _probed:
        _probed[device] = _probe()
    return _probed[device]


def _probe() -> tuple[str | None, str]:
    try:
        import pynvml
    except ImportError as e:
        return None, f"GPU affinity unknown: pynvml not importable ({e}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound etc.
        return None, f"GPU affinity unknown: NVML not usable ({type(e).__name__})"
    try:
        import torch

        if not torch.cuda.is_available():
            pynvml.nvmlShutdown()
            return None, "GPU affinity unknown: NVML usable but no CUDA device in this process"
        device = torch.cuda.current_device()
    except Exception as e:  # noqa: BLE001 - a probe: any failure means "unknown"
        return None, f"GPU affinity unknown: CUDA probe failed ({e})"
    try:
        bus = _pci_bus_id(device)
        handle = (pynvml.nvmlDeviceGetHandleByPciBusId(bus) if bus
                  else pynvml.nvmlDeviceGetHandleByIndex(device))
        try:
            return f"numa{pynvml.nvmlDeviceGetNumaNodeId(handle)}", "GPU NUMA node from NVML"
        except Exception:  # noqa: BLE001 - older NVML: fall back to the CPU affinity mask
            size = max(1, (os.cpu_count() or 64) // 64 + 1)
            words = pynvml.nvmlDeviceGetCpuAffinity(handle, size)
            return "cpus" + "-".join(f"{w:x}" for w in words), "GPU CPU-affinity mask from NVML"
    except Exception as e:  # noqa: BLE001
        return None, f"GPU affinity unknown: NVML query failed ({type(e).__name__}: {e})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
