"""The methods the benchmark compares: one small registry entry each.

A method knows how to save the state dict durably (fsync included) to a path and load it back
cold. To add a row, subclass :class:`Method` and decorate it with :func:`register` (or call
``register`` with a factory for several variants, as the gds_persist backends do)::

    @register
    class MyWriter(Method):
        key, label = "mine", "my writer"

        def save(self, ctx, path):  # must be durable when it returns
            ...

        def load(self, ctx, path):
            return ...

``unavailable(ctx)`` returns why a method cannot run here (or None); ``prepare(ctx)`` runs once,
untimed, before the first save (conversions, calibration) and adds to ``notes`` for the report.
A load must leave the data in memory: set ``lazy_load = True`` if ``load`` returns tensors over
a file mapping, and the harness touches every page inside the timed region.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gds_persist.transfer.commit import fsync_path

from .state import StateSummary, iter_tensors

# DCP warns on every call without a process group even when asked for no_dist explicitly.
_DCP_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


@dataclass
class Context:
    """What every method sees: the state dict, where to write, and run options."""

    sd: Any
    summary: StateSummary
    workdir: str
    device: torch.device
    dcp_threads: tuple[int, ...] = (1, 2, 4)
    o_direct: bool = True

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Method:
    """One row of the benchmark (a save and a cold load)."""

    key: str = ""  # CLI name, e.g. "torch"
    label: str = ""  # row label of the save, e.g. "torch.save"
    load_label: str = ""  # row label of the load if it differs, e.g. "torch.load"
    baseline: bool = False  # the row others' speed-up is measured against
    # True when load() may return tensors over a file mapping whose bytes are read on first
    # touch; the harness then touches every page inside the timed load (see touch_pages)
    lazy_load: bool = False

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.info: dict[str, Any] = {}

    def unavailable(self, ctx: Context) -> str | None:
        return None

    def prepare(self, ctx: Context) -> None:
        """Untimed, once, before the first save."""

    def save(self, ctx: Context, path: str) -> None:
        raise NotImplementedError

    def load(self, ctx: Context, path: str) -> Any:
        raise NotImplementedError

    def loaded_tensors(self, ctx: Context, loaded: Any) -> dict[str, torch.Tensor]:
        """The loaded tensors keyed like :func:`bench.state.iter_tensors` keys the original."""
        return dict(iter_tensors(loaded))


REGISTRY: dict[str, Callable[[], Method]] = {}


def register(factory: Callable[[], Method], key: str | None = None) -> Callable[[], Method]:
    """Add a method (a Method subclass, or a factory returning one) under its key."""
    name = key or getattr(factory, "key", "")
    if not name or name in REGISTRY:
        raise ValueError(f"method key {name!r} is empty or already registered")
    REGISTRY[name] = factory
    return factory


def not_importable(module: str, fix: str = "") -> str | None:
    """Why ``module`` cannot be imported here, ``fix`` appended (None: it can)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"{module} not importable ({e}){fix}"
    return None


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def disk_bytes(path: str) -> int:
    """Bytes of all files at ``path`` (a file or a directory tree)."""
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(root, n))
               for root, _, names in os.walk(path) for n in names)


def touch_pages(tensors: list[torch.Tensor]) -> int:
    """Read one byte of every 4 KiB page of each distinct CPU storage; returns bytes covered.

    Part of the timed load of methods with ``lazy_load`` (safetensors' ``load_file`` returns
    tensors over a private ``mmap``; the bytes arrive on first touch), so that they are charged
    for reading their data like the eager loaders. Not applied to eager loaders: on resident
    memory it still costs about 30 ms per GiB (a TLB miss per page).
    """
    seen: set[int] = set()
    covered = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw[::4096].sum()
        raw[-1].item()
        covered += storage.nbytes()
    return covered


# --------------------------------------------------------------------------- gds_persist


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (e.g. ``KVIKIO_COMPAT_MODE``)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class GdsPersist(Method):
    """``gds_persist.save`` / ``load`` with one backend forced.

    Variants are one line each: ``settings`` go through ``gds_persist.settings.set`` and ``env``
    into the environment around every call, e.g. a row with larger staging blocks::

        register(lambda: GdsPersist("direct", variant="64MiB",
                                    settings={"block_bytes": 64 << 20,
                                              "staging_bytes": 256 << 20}),
                 key="gds-direct-64MiB")

    (Not ``env={"KVIKIO_COMPAT_MODE": ...}``: KvikIO reads it once per process, so such a row
    would silently run in whatever mode came first; see :class:`GdsKvikio`.)
    """

    def __init__(self, backend: str, *, variant: str = "", settings: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, file_format: str = "directory"):
        super().__init__()
        self.backend = backend
        self.file_format = file_format
        self.settings = dict(settings or {})
        self.env = dict(env or {})
        self.key = f"gds-{backend}" + (f"-{variant}" if variant else "")
        self.label = f"gds_persist {backend}" + (f" {variant}" if variant else "")

    @contextmanager
    def _scope(self) -> Iterator[None]:
        import gds_persist

        with _environment(self.env), gds_persist.settings.set(**self.settings):
            yield

    def prepare(self, ctx: Context) -> None:
        shown = {**self.settings, **self.env}
        if shown:
            self.notes.append("with " + ", ".join(f"{k}={v}" for k, v in shown.items()))
        if ctx.device.type == "cuda" and self.backend != "kvikio":
            self.notes.append("CUDA tensors: device-to-host copies into the pinned staging ring "
                              "on a side stream, overlapped with the writes of earlier buffers "
                              "(loads: host-to-device on the side stream)")

    def unavailable(self, ctx: Context) -> str | None:
        if self.backend == "direct" and not ctx.o_direct:
            return f"{ctx.workdir} does not accept O_DIRECT"
        if self.backend == "kvikio":
            if ctx.device.type != "cuda":
                return "needs CUDA tensors (--device cuda)"
            from gds_persist.backends.kvikio_backend import kvikio_status

            with _environment(self.env):
                usable, why = kvikio_status()
            if not usable:
                return why
        return None

    def save(self, ctx: Context, path: str) -> None:
        import gds_persist

        with self._scope():
            info = gds_persist.save(ctx.sd, path, backend=self.backend,
                                    format=self.file_format)
        self.info = {"backend": info.backend, "reason": info.reason,
                     "bytes_written": info.bytes_written}

    def load(self, ctx: Context, path: str) -> Any:
        import gds_persist

        with self._scope():
            state, info = gds_persist.load_with_info(path, backend=self.backend)
        self.info.update(load_backend=info.backend, load_reason=info.reason)
        return state


for _backend in ("auto", "direct", "buffered"):
    register(lambda b=_backend: GdsPersist(b), key=f"gds-{_backend}")


def _torch_file() -> GdsPersist:
    """The torch.save container written and read by the engine (one file torch.load reads)."""
    method = GdsPersist("auto", file_format="torch")
    method.key, method.label = "gds-torch", "gds_persist auto, torch file"
    return method


register(_torch_file, key="gds-torch")


class GdsKvikio(GdsPersist):
    """``backend="kvikio"`` from CUDA memory: GPUDirect Storage where cuFile has it, else
    cuFile's compatibility mode (``gds-kvikio``), or KvikIO's own POSIX compatibility mode
    forced (``gds-kvikio-compat``). The label says which mode ran. A kvikio row that did not
    actually run through kvikio (the probe fell back to ``direct``, or cuFile failed mid-save)
    raises, so it is reported as FAILED with the reason rather than timed under a wrong name.

    The compat variant uses ``kvikio.defaults.set("compat_mode", ON)`` around each call:
    KvikIO reads ``KVIKIO_COMPAT_MODE`` from the environment only once per process.
    """

    def __init__(self, compat: bool = False):
        super().__init__("kvikio", variant="compat" if compat else "")
        self.compat = compat

    @contextmanager
    def _scope(self) -> Iterator[None]:
        if not self.compat:
            with super()._scope():
                yield
            return
        import kvikio
        import kvikio.defaults

        with super()._scope(), kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON):
            yield

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        from gds_persist.backends.kvikio_backend import gds_mode, import_kvikio

        with self._scope():
            gds, mode = gds_mode(import_kvikio())
        self.label = kvikio_label(gds, mode)
        self.info["mode"] = mode
        self.notes.append(f"mode: {mode}")

    def save(self, ctx: Context, path: str) -> None:
        super().save(ctx, path)
        reason = self.info.get("reason", "")
        if self.info.get("backend") != "kvikio" or "fell back" in reason:
            raise RuntimeError(f"the kvikio row did not run through kvikio: {reason}")


def kvikio_label(gds: bool, mode: str) -> str:
    """The kvikio row's name, naming the I/O that ran, within the table's 30 characters:
    GDS, cuFile (cuFile's compatibility mode), KvikIO (KvikIO's own POSIX compatibility mode,
    which KvikIO takes by itself where it finds no usable cuFile) or KvikIO ON (forced)."""
    if gds:
        short = "GDS"
    elif mode.startswith("KvikIO compatibility mode forced"):
        short = "KvikIO ON"
    elif mode.startswith("KvikIO"):
        short = "KvikIO"
    else:
        short = "cuFile"
    return f"gds_persist kvikio ({short})"


register(GdsKvikio, key="gds-kvikio")
register(lambda: GdsKvikio(compat=True), key="gds-kvikio-compat")


# --------------------------------------------------------------------------- torch.save


@register
class TorchSave(Method):
    key = "torch"
    label = "torch.save"
    load_label = "torch.load"
    baseline = True

    def prepare(self, ctx: Context) -> None:
        self.notes.append("file fsynced, then its directory; load with weights_only=True")

    def save(self, ctx: Context, path: str) -> None:
        with open(path, "wb") as f:
            torch.save(ctx.sd, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(os.path.dirname(path))

    def load(self, ctx: Context, path: str) -> Any:
        return torch.load(path, map_location=ctx.device, weights_only=True, mmap=False)


# --------------------------------------------------------------------------- DCP


def _empty_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_empty_like(v) for v in obj)
    return obj


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_NO_DIST)
        yield


@register
class DcpFileSystem(Method):
    """PyTorch DCP ``dcp.save`` with ``FileSystemWriter`` (``sync_files=True``, its default:
    every data file and the metadata are fsynced) at its best thread count here.

    Another DCP storage backend is a subclass overriding ``writer``/``reader`` (and ``key``,
    ``label``, ``load_label``, ``describe``); ``thread_count`` is what the calibration varies.
    """

    key = "dcp"
    label = "DCP FileSystemWriter"
    load_label = "DCP FileSystemReader"
    describe = ("sync_files=True (default); no directory fsync; tied tensors stored once per "
                "key; load into preallocated tensors (allocation timed)")

    def writer(self, path: str, thread_count: int) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(path, thread_count=thread_count, sync_files=True)

    def reader(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemReader(path)

    def __init__(self) -> None:
        super().__init__()
        self.threads = 1

    def unavailable(self, ctx: Context) -> str | None:
        return not_importable("torch.distributed.checkpoint")

    def prepare(self, ctx: Context) -> None:
        counts = sorted(set(ctx.dcp_threads))
        if len(counts) > 1:
            timings: dict[int, float] = {}
            for t in counts:
                path = os.path.join(ctx.workdir, f"dcp-calibrate-{t}")
                os.sync()
                t0 = time.perf_counter()
                self._save(ctx, path, t)
                timings[t] = time.perf_counter() - t0
                remove(path)
            self.threads = min(timings, key=lambda t: timings[t])
            self.info["calibration_s"] = {str(t): s for t, s in timings.items()}
            shown = ", ".join(f"{t}: {s:.2f}s" for t, s in timings.items())
            self.notes.append(f"thread_count={self.threads} chosen by one save each ({shown})")
        else:
            self.threads = counts[0]
            self.notes.append(f"thread_count={self.threads} (given)")
        self.info["thread_count"] = self.threads
        self.label = f"{self.label} t={self.threads}"
        self.notes.append(self.describe)

    def _save(self, ctx: Context, path: str, threads: int) -> None:
        import torch.distributed.checkpoint as dcp

        with _quiet_dcp():
            dcp.save(ctx.sd, storage_writer=self.writer(path, threads), no_dist=True)

    def save(self, ctx: Context, path: str) -> None:
        self._save(ctx, path, self.threads)

    def load(self, ctx: Context, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        target = _empty_like(ctx.sd)
        with _quiet_dcp():
            dcp.load(target, storage_reader=self.reader(path), no_dist=True)
        return target


@register
class DcpGdsPersist(DcpFileSystem):
    """``dcp.save`` / ``dcp.load`` unchanged, with gds_persist's DCP storage backend
    (``gds_persist.dcp.GdsPersistWriter`` / ``GdsPersistReader``) instead of FileSystemWriter."""

    key = "dcp-gds"
    label = "DCP GdsPersistWriter"
    load_label = "DCP GdsPersistReader"
    describe = ("gds_persist.dcp: backend auto (aligned O_DIRECT here, kvikio for CUDA tensors "
                "when usable), CRC32C per extent verified on load, atomic commit with directory "
                "fsync; single process, so no byte-range balancing (tests/test_dcp.py and "
                "bench/bench_dcp.py measure that with several ranks)")

    def writer(self, path: str, thread_count: int) -> Any:
        from gds_persist.dcp import GdsPersistWriter

        return GdsPersistWriter(path)

    def reader(self, path: str) -> Any:
        from gds_persist.dcp import GdsPersistReader

        return GdsPersistReader(path)

    def prepare(self, ctx: Context) -> None:  # no thread count to calibrate
        self.notes.append(self.describe)

    def save(self, ctx: Context, path: str) -> None:
        super().save(ctx, path)
        import gds_persist

        writer = gds_persist.read_manifest(path).writer
        self.info = {"backend": writer.get("backend"), "reason": writer.get("reason")}


# --------------------------------------------------------------------------- safetensors


def _without_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return {str(k): _without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_without_tensors(v) for v in obj]
    return obj


@register
class SafeTensors(Method):
    """``safetensors.torch.save_file`` + fsync. The format holds a flat ``{name: tensor}`` of
    contiguous tensors that do not share memory, so tied or non-contiguous tensors are cloned
    (before timing) and the non-tensor leaves go into its string metadata as JSON."""

    key = "safetensors"
    label = "safetensors save_file"
    load_label = "safetensors load_file"
    lazy_load = True  # load_file maps the file; pages are read on first touch

    def __init__(self) -> None:
        super().__init__()
        self.flat: dict[str, torch.Tensor] = {}
        self.metadata: dict[str, str] = {}

    def unavailable(self, ctx: Context) -> str | None:
        return not_importable("safetensors.torch", "; pip install safetensors")

    def prepare(self, ctx: Context) -> None:
        seen: set[tuple[str, int]] = set()
        cloned, cloned_bytes = 0, 0
        for name, t in iter_tensors(ctx.sd):
            storage = (str(t.device), t.untyped_storage().data_ptr())
            if storage in seen or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
                cloned += 1
                cloned_bytes += t.numel() * t.element_size()
            seen.add(storage)
            self.flat[name] = t
        self.metadata = {"non_tensor_state": json.dumps(_without_tensors(ctx.sd))}
        self.info["cloned_tensors"] = cloned
        self.info["cloned_bytes"] = cloned_bytes
        self.notes.append(f"flat dotted keys; {cloned} tied/non-contiguous tensor(s) "
                          f"({cloned_bytes / 2**20:.1f} MiB) cloned before timing and written "
                          "again; non-tensor leaves as JSON metadata; load_file only maps the "
                          "file, so its timed load includes touching every page")

    def save(self, ctx: Context, path: str) -> None:
        from safetensors.torch import save_file

        save_file(self.flat, path, metadata=self.metadata)
        fsync_path(path)
        fsync_path(os.path.dirname(path))

    def load(self, ctx: Context, path: str) -> Any:
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))

    def loaded_tensors(self, ctx: Context, loaded: Any) -> dict[str, torch.Tensor]:
        return dict(loaded)


# --------------------------------------------------------------------------- selection


@dataclass
class Selection:
    available: list[Method] = field(default_factory=list)
    unavailable: list[tuple[Method, str]] = field(default_factory=list)


def select(ctx: Context, keys: list[str] | None = None) -> Selection:
    """Instantiate the requested (default: all) methods; split by availability here."""
    unknown = [k for k in keys or [] if k not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(REGISTRY)}")
    out = Selection()
    for key in keys or list(REGISTRY):
        method = REGISTRY[key]()
        try:
            why = method.unavailable(ctx)
        except Exception as e:  # noqa: BLE001 - an availability probe never stops the run
            why = f"availability probe failed: {type(e).__name__}: {e}"
        if why:
            out.unavailable.append((method, why))
        else:
            out.available.append(method)
    return out
