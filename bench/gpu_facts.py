"""What the GPU path will find on this machine: GPU, driver, PCIe, NUMA, kvikio/GDS mode and why,
the device CRC kernel. Never raises; on a machine without a GPU it says so.

    python bench/gpu_facts.py [--json OUT]      # prints a short report; exit 0 always

Used by bench/gpu_check.sh for the header of its summary (and its ``cuda`` field decides whether
there is anything to verify).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a fact that cannot be had is reported, not raised
        return f"unavailable ({type(e).__name__}: {e})"


def facts() -> dict[str, Any]:
    import torch

    from gds_persist.parallel.topology import topology

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda}
    out["cuda"] = bool(_try(torch.cuda.is_available) is True)
    if out["cuda"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        out["why_no_cuda"] = "torch.cuda.is_available() is False"
    topo = topology()
    out["nvml"] = topo.reason
    out["topology"] = topo.as_dict()
    out["gpu_summary"] = topo.summary()
    out["nvidia_fs_loaded"] = os.path.exists("/proc/driver/nvidia-fs")
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        out["cupy"] = f"not importable ({e})"
    try:
        from gds_persist.backends.kvikio_backend import (
            compat_mode_name,
            gds_mode,
            import_kvikio,
            kvikio_status,
        )

        kvikio = import_kvikio()
        out["kvikio"] = kvikio.__version__
        out["kvikio_compat_mode"] = _try(lambda: compat_mode_name(kvikio))
        version = _try(kvikio.cufile_driver.libcufile_version)
        out["libcufile"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
        usable, why = kvikio_status()
        out["kvikio_usable"], out["kvikio_status"] = usable, why
        if out["cuda"]:  # without a driver, libcufile's own probes can hang: ask only with one
            gds, mode = gds_mode(kvikio)
            out["gds"], out["gds_mode"] = gds, mode
        else:
            out["gds"], out["gds_mode"] = False, "no CUDA device"
    except Exception as e:  # noqa: BLE001
        out["kvikio"] = f"not importable ({e})"
        out["kvikio_usable"], out["gds"] = False, False
    from gds_persist.transfer.device_crc import device_crc_status

    out["device_crc"] = device_crc_status()[1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    f = facts()
    for key in ("gpu_summary", "cuda", "torch", "torch_cuda", "cupy", "kvikio",
                "kvikio_compat_mode", "libcufile", "nvidia_fs_loaded", "kvikio_status",
                "gds_mode", "device_crc", "why_no_cuda"):
        if key in f:
            print(f"{key:<20} {f[key]}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(f, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
