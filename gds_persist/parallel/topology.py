"""Where this process runs: its node, and its GPUs through NVML (nvidia-ml-py).

* :func:`topology`: every GPU's name, driver, PCIe link, NUMA node and CPU affinity, for the
  benchmark header and for placing I/O threads near the GPU whose memory they move
  (:func:`cpus_near`, :func:`bind_current_thread_near`).
* :func:`node_name` and :func:`gpu_affinity`: the node identity and this process's GPU affinity
  group, used to place writers (``gds_persist.parallel.schedule.choose_writers``).

Nothing here raises: on a machine without NVML (no driver, no GPU, nvidia-ml-py missing)
:func:`topology` returns ``nvml=False`` with the reason ("no NVML: ...") and defaults (no GPUs,
every CPU this process may run on), and :func:`gpu_affinity` returns ``None`` with the reason, so
the scheduler spreads writers evenly by local rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str = ""
    pci_bus_id: str = ""
    memory_bytes: int = 0
    pcie_gen: int | None = None  # current link generation (may idle lower than max)
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    numa_node: int | None = None  # None: unknown or not a NUMA machine
    cpus: tuple[int, ...] = ()  # CPUs NVML calls local to this GPU; () when unknown

    @property
    def pcie(self) -> str:
        if self.pcie_max_gen is None and self.pcie_gen is None:
            return "PCIe unknown"
        return (f"PCIe gen{self.pcie_gen}x{self.pcie_width} "
                f"(max gen{self.pcie_max_gen}x{self.pcie_max_width})")


@dataclass(frozen=True)
class Topology:
    nvml: bool
    reason: str  # "NVML <version>" or "no NVML: <why>"
    driver: str | None = None
    cuda_driver: str | None = None  # e.g. "13.0"
    gpus: tuple[GpuInfo, ...] = ()
    notes: tuple[str, ...] = field(default=())  # attributes NVML could not report

    def summary(self) -> str:
        """One line for benchmark headers."""
        if not self.gpus:
            return f"no GPU ({self.reason})"
        g = self.gpus[0]
        more = f" (+{len(self.gpus) - 1} more)" if len(self.gpus) > 1 else ""
        return (f"{g.name}{more}, {g.memory_bytes / 2**30:.0f} GiB, driver {self.driver}, "
                f"CUDA {self.cuda_driver}, {g.pcie}, NUMA node {g.numa_node}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _process_cpus() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def _mask_to_cpus(words: Any) -> tuple[int, ...]:
    cpus = []
    for w, word in enumerate(words):
        word = int(word)
        for bit in range(64):
            if word >> bit & 1:
                cpus.append(w * 64 + bit)
    return tuple(cpus)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sysfs_numa_node(bus_id: str) -> int | None:
    # NVML: "00000000:3B:00.0"; sysfs: "0000:3b:00.0"
    short = bus_id.lower()[-12:]
    try:
        with open(f"/sys/bus/pci/devices/{short}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _gpu(nvml: Any, index: int, notes: list[str]) -> GpuInfo:
    h = nvml.nvmlDeviceGetHandleByIndex(index)

    def ask(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(h, *args)
        except Exception as e:  # noqa: BLE001 - NVMLError_NotSupported and friends
            notes.append(f"GPU {index}: {what} unavailable ({e})")
            return None

    bus_id = ask("PCI info", nvml.nvmlDeviceGetPciInfo)
    bus = _text(bus_id.busId) if bus_id is not None else ""
    memory = ask("memory info", nvml.nvmlDeviceGetMemoryInfo)
    numa = None
    if hasattr(nvml, "nvmlDeviceGetNumaNodeId"):
        try:
            numa = int(nvml.nvmlDeviceGetNumaNodeId(h))
        except Exception:  # noqa: BLE001 - not supported on many systems: use sysfs
            numa = None
    if numa is None and bus:
        numa = _sysfs_numa_node(bus)
    words = (os.cpu_count() or 64) // 64 + 1
    mask = ask("CPU affinity", nvml.nvmlDeviceGetCpuAffinity, words)
    return GpuInfo(
        index=index,
        name=_text(ask("name", nvml.nvmlDeviceGetName) or "unknown GPU"),
        uuid=_text(ask("UUID", nvml.nvmlDeviceGetUUID) or ""),
        pci_bus_id=bus,
        memory_bytes=int(memory.total) if memory is not None else 0,
        pcie_gen=ask("PCIe generation", nvml.nvmlDeviceGetCurrPcieLinkGeneration),
        pcie_width=ask("PCIe width", nvml.nvmlDeviceGetCurrPcieLinkWidth),
        pcie_max_gen=ask("max PCIe generation", nvml.nvmlDeviceGetMaxPcieLinkGeneration),
        pcie_max_width=ask("max PCIe width", nvml.nvmlDeviceGetMaxPcieLinkWidth),
        numa_node=numa,
        cpus=_mask_to_cpus(mask) if mask is not None else (),
    )


def topology() -> Topology:
    """What NVML reports about the GPUs of this machine; never raises."""
    try:
        import pynvml as nvml
    except Exception as e:  # noqa: BLE001
        return Topology(False, f"no NVML: nvidia-ml-py not importable ({e})")
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return Topology(False, f"no NVML: nvmlInit failed ({type(e).__name__}: {e})")
    notes: list[str] = []
    try:
        driver: str | None = None
        cuda: str | None = None
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as e:  # noqa: BLE001
            notes.append(f"driver version unavailable ({e})")
        try:
            v = int(nvml.nvmlSystemGetCudaDriverVersion())
            cuda = f"{v // 1000}.{v % 1000 // 10}"
        except Exception as e:  # noqa: BLE001
            notes.append(f"CUDA driver version unavailable ({e})")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:  # noqa: BLE001
            return Topology(False, f"no NVML: nvmlDeviceGetCount failed ({e})", driver, cuda)
        gpus = []
        for i in range(count):
            try:
                gpus.append(_gpu(nvml, i, notes))
            except Exception as e:  # noqa: BLE001
                notes.append(f"GPU {i}: not queryable ({e})")
        try:
            version = _text(nvml.nvmlSystemGetNVMLVersion())
        except Exception:  # noqa: BLE001
            version = "?"
        return Topology(True, f"NVML {version}", driver, cuda, tuple(gpus), tuple(notes))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def cpus_near(gpu_index: int, topo: Topology | None = None) -> tuple[int, ...]:
    """CPUs local to GPU ``gpu_index`` that this process may use; every allowed CPU when NVML
    does not know (no NVML, no such GPU, no affinity information, or no overlap)."""
    allowed = _process_cpus()
    topo = topo if topo is not None else topology()
    for g in topo.gpus:
        if g.index == gpu_index and g.cpus:
            near = tuple(c for c in g.cpus if c in set(allowed))
            if near:
                return near
    return allowed


def bind_current_thread_near(gpu_index: int, topo: Topology | None = None) -> tuple[int, ...]:
    """Restrict the calling thread (e.g. an I/O thread) to the CPUs near ``gpu_index``; returns
    them. A no-op where the platform cannot set affinity."""
    cpus = cpus_near(gpu_index, topo)
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread on Linux
    except (AttributeError, OSError):
        pass
    return cpus


# --- node identity and this process's GPU affinity (writer placement) ----------------------

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
