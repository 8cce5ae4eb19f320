"""``backend="auto"``: which backend, decided from a described environment.

:func:`decide` is a pure function of an :class:`AutoEnvironment` (what the caller found: CUDA
tensors or not, whether kvikio is usable and whether cuFile runs in GPUDirect Storage mode,
whether the filesystem takes O_DIRECT, the ``auto_kvikio`` setting), so the rule is tested for
every case without the hardware. :func:`gds_persist.backends.choose_backend` gathers the facts and
builds the backend it names.

The rule, from what was measured:

* no CUDA tensors: ``direct`` where the filesystem takes O_DIRECT, else ``buffered``;
* CUDA tensors and cuFile in **GDS mode** (nvidia-fs loaded): ``kvikio`` (DMA between GPU memory
  and the drive, no host bounce; ``choose_backend`` still probes it and falls back with the reason);
* CUDA tensors and kvikio only in a **compatibility mode** (cuFile's or KvikIO's own POSIX path):
  ``direct`` (or ``buffered``), because there the pinned side-stream pipeline was faster:
  on one H200 (no nvidia-fs), a durable 8 GiB save from GPU memory ran at 2.34 GB/s with
  ``direct`` against 1.59 with ``kvikio`` in compatibility mode, and a cold load at 2.06 against
  1.47 (:data:`MEASURED`);
* ``auto_kvikio="always"`` (``GDS_PERSIST_AUTO_KVIKIO=always``) takes ``kvikio`` wherever it is
  usable: for a machine where a measurement (``bench/bench_io.py --device cuda``) says it is
  faster; ``"never"`` never takes it. ``backend="kvikio"`` itself always means kvikio.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where the compatibility-mode rule comes from (the doc section cites the measurement's file).
MEASURED = ("docs/GPU.md, \"What happens to CUDA tensors\": H200, cuFile without nvidia-fs, "
            "8 GiB from GPU memory, durable save direct 2.34 vs kvikio 1.59 GB/s, "
            "cold load 2.06 vs 1.47")


@dataclass(frozen=True)
class KvikioFacts:
    """What the kvikio backend would be here."""

    usable: bool  # kvikio importable and a CUDA device/driver
    gds: bool  # cuFile runs in GPUDirect Storage mode (False: a compatibility mode, or unusable)
    why: str  # the mode, or why kvikio is not usable


@dataclass(frozen=True)
class AutoEnvironment:
    """The facts ``auto`` decides from (``kvikio`` is None when it was not examined)."""

    wants_device: bool  # the tensors to write (or the load's destinations) are CUDA tensors
    o_direct: bool
    o_direct_why: str
    kvikio: KvikioFacts | None = None
    auto_kvikio: str = "gds"  # the setting (gds_persist.settings.AUTO_KVIKIO)


def decide(env: AutoEnvironment) -> tuple[str, str]:
    """``(backend name, reason)`` for ``backend="auto"``; the reason starts with ``"auto: "``."""
    posix = "direct" if env.o_direct else "buffered"  # the staging ring either way
    if not env.wants_device:
        return posix, f"auto: {env.o_direct_why}; kvikio not used (no CUDA tensors)"
    k = env.kvikio
    if env.auto_kvikio == "never":
        skipped = "auto_kvikio='never'"
    elif k is None:
        skipped = "kvikio not examined"
    elif not k.usable:
        skipped = k.why
    elif k.gds:
        return "kvikio", f"auto: CUDA tensors and cuFile in GPUDirect Storage mode ({k.why})"
    elif env.auto_kvikio == "always":
        return "kvikio", (f"auto: CUDA tensors and kvikio usable ({k.why}); auto_kvikio='always' "
                          "takes kvikio in compatibility mode too")
    else:
        skipped = (f"{k.why}; in compatibility mode kvikio is POSIX I/O through bounce buffers, "
                   f"measured slower than the pinned staging pipeline ({MEASURED}); "
                   "GDS_PERSIST_AUTO_KVIKIO=always takes kvikio where a measurement here says "
                   "it is faster")
    return posix, f"auto: {env.o_direct_why}; kvikio not used ({skipped})"
