"""The GPU path: kvikio backend (settings, probe, fallback, cufile.log), side-stream copies,
NVML topology.

On this CPU-only machine kvikio, cupy and nvidia-ml-py are the real packages, failing for real
(no libcuda.so.1, no NVML library): these tests check that every such failure ends in a clean
fallback or a clear message. Tests marked ``gpu`` need a CUDA device and skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gds_persist
from gds_persist.backends.posix import memory_backed
from gds_persist.parallel.topology import Topology, bind_current_thread_near, cpus_near, topology
from gds_persist.transfer.cuda_copy import StreamCopier, copier_for

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def _kvikio_or_skip():
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"kvikio not importable ({e}); pip install 'gds_persist[gpu]'")
    from gds_persist.backends import kvikio_backend

    return kvikio_backend


def _state_dict(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1000, 37, generator=g).to(device),
        "b": torch.randn(4097, generator=g).to(torch.bfloat16).to(device),
        "tiny": torch.tensor([1, 2, 3], dtype=torch.int8).to(device),
        "empty": torch.empty(0, device=device),
        "step": 7,
    }


def _data_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("data-*"))}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- kvikio: status, settings, probe, fallback ---------------------------------------------------

def test_kvikio_status_says_why():
    kb = _kvikio_or_skip()
    usable, why = kb.kvikio_status()
    if not CUDA:
        assert not usable
        assert "no usable CUDA device" in why
    else:
        assert usable and "kvikio usable" in why


def test_kvikio_settings_come_from_ours():
    """Real kvikio.defaults (setting them needs no driver); restored afterwards."""
    kb = _kvikio_or_skip()
    import kvikio.defaults as kd

    before = {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")}
    with kd.set(before):  # restores on exit, whatever the backend set
        be = kb.KvikioBackend(io_threads=3, task_size=1 << 20)
        assert kd.get("num_threads") == 3
        assert kd.get("task_size") == 1 << 20
        assert be.settings_note == "kvikio num_threads=3, task_size=1048576"
        kb.KvikioBackend(io_threads=5, task_size=2 << 20)
        assert (kd.get("num_threads"), kd.get("task_size")) == (5, 2 << 20)
    assert {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")} == before


def test_kvikio_settings_follow_gds_persist_settings(tmp_path):
    """io_threads/block_bytes given to save() reach kvikio when the kvikio backend is chosen."""
    kb = _kvikio_or_skip()
    import kvikio.defaults as kd

    before = {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")}
    with kd.set(before):
        with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=4 << 20, io_threads=2):
            gds_persist.save(_state_dict(), tmp_path / "ck", backend="kvikio")
        assert (kd.get("num_threads"), kd.get("task_size")) == (2, 1 << 20)
    assert kb  # imported


@pytest.mark.skipif(CUDA, reason="checks the no-driver fallback; this machine has CUDA")
def test_kvikio_requested_without_driver_falls_back_for_real(tmp_path):
    """backend='kvikio' here: the real cuFile probe fails (no libcuda.so.1); the save goes to
    the direct backend, says why, and produces the same files as backend='direct'."""
    _kvikio_or_skip()
    sd = _state_dict()
    fds = _open_fds()
    info = gds_persist.save(sd, tmp_path / "kv", backend="kvikio")
    assert info.backend == "direct"
    assert info.reason.startswith("requested explicitly, but kvikio cannot work here")
    assert "cuFile probe" in info.reason and "libcuda" in info.reason
    assert "fell back to direct" in info.reason
    manifest = (tmp_path / "kv" / "manifest.json").read_text()
    assert "fell back to direct" in manifest  # recorded in the checkpoint too
    gds_persist.save(sd, tmp_path / "direct", backend="direct")
    assert _data_files(tmp_path / "kv") == _data_files(tmp_path / "direct")
    out = gds_persist.load(tmp_path / "kv", backend="kvikio")
    for k in ("w", "b", "tiny", "empty"):
        assert torch.equal(out[k], sd[k])
    assert out["step"] == 7
    assert _open_fds() == fds
    assert not list(tmp_path.glob("**/.kvikio_probe-*"))  # the probe file is removed


@pytest.mark.skipif(CUDA, reason="checks the no-driver guard; this machine has CUDA")
def test_probe_never_calls_cufile_in_forced_gds_mode_without_driver(tmp_path):
    """KVIKIO_COMPAT_MODE=OFF without a driver: libcufile's handle registration spins forever
    on this machine (seen in gdb: cuFileHandleRegister in an endless getline). The probe must
    refuse quickly instead of calling it."""
    kb = _kvikio_or_skip()
    import kvikio
    import kvikio.defaults as kd

    be = kb.KvikioBackend(io_threads=kd.get("num_threads"), task_size=kd.get("task_size"))
    with kd.set("compat_mode", kvikio.CompatMode.OFF):
        t0 = time.monotonic()
        ok, why = be.probe(str(tmp_path))
    assert not ok and "can hang" in why
    assert time.monotonic() - t0 < 5
    info = gds_persist.save(_state_dict(), tmp_path / "ck", backend="kvikio")
    assert info.backend == "direct"


def test_kvikio_host_buffers_and_bounce_io_round_trip(tmp_path):
    """The I/O the backend does itself (host buffers, and the pinned bounce path it falls back
    to when cuFile fails mid-save), at every alignment edge, through a real O_DIRECT file."""
    kb = _kvikio_or_skip()
    import kvikio.defaults as kd

    from gds_persist.backends.buffers import AlignedBuffer

    before = {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")}
    with kd.set(before):
        be = kb.KvikioBackend(io_threads=2, task_size=8192)  # small bounce: several pieces
    sizes = [1, 511, 4095, 4096, 4097, 8191, 8192, 8193, 3 * 8192 + 5]
    offsets, offset = [], 0
    for n in sizes:
        offsets.append(offset)
        offset += -(-n // 4096) * 4096
    path = str(tmp_path / "f.bin")
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    fds = _open_fds()
    h = be.open(path, write=True, size=offset + 4096)
    try:
        assert h.direct  # /tmp is ext4 here: O_DIRECT
        for t, off in zip(tensors, offsets, strict=True):
            be.bounce_write(h, t, off)
        with AlignedBuffer(4096, pin=False) as host:
            host.tensor.fill_(0xAB)
            be.pwrite(h, host.view, offset)  # host buffer: straight to our descriptor
        be.sync(h)
    finally:
        be.close(h)
    data = Path(path).read_bytes()
    assert len(data) == offset + 4096
    assert data[offset:] == b"\xab" * 4096
    h = be.open(path, write=False)
    try:
        for t, off in zip(tensors, offsets, strict=True):
            assert data[off : off + t.numel()] == t.numpy().tobytes()
            back = torch.empty_like(t)
            assert be.bounce_read(h, back, off) == t.numel()
            assert torch.equal(back, t)
        with AlignedBuffer(4096, pin=False) as host:
            assert be.pread(h, host.view, offset) == 4096
            assert bytes(host.view) == b"\xab" * 4096
        tail = torch.empty(10_000, dtype=torch.uint8)
        assert be.bounce_read(h, tail, offset) == 4096  # short only at the end of the file
    finally:
        be.close(h)
    assert _open_fds() == fds


def test_no_cufile_log_in_working_directory(tmp_path):
    """Make libcufile really load and log (KVIKIO_COMPAT_MODE=OFF; on this machine it then
    hangs in driver_open, so the child is killed once the log exists): the log must land in
    gds_persist's location, not the cwd. A control run without gds_persist shows the cwd log."""
    _kvikio_or_skip()
    child = textwrap.dedent("""
        import sys
        if sys.argv[1] == "gds_persist":
            from gds_persist.backends.kvikio_backend import import_kvikio
            kvikio = import_kvikio()
        else:
            import kvikio, kvikio.cufile_driver
        print("ready", flush=True)
        kvikio.cufile_driver.driver_open()  # loads libcufile; returns on a GPU machine
    """)

    def run(mode: str, cwd: Path, tmpdir: Path) -> Path | None:
        env = {k: v for k, v in os.environ.items() if k != "CUFILE_LOGFILE_PATH"}
        env.update(KVIKIO_COMPAT_MODE="OFF", TMPDIR=str(tmpdir),
                   PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
        routed = tmpdir / f"gds_persist-cufile-{os.getuid()}.log"
        proc = subprocess.Popen([sys.executable, "-c", child, mode], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and proc.poll() is None:
                if (cwd / "cufile.log").exists() or routed.exists():
                    time.sleep(0.5)  # let it finish the first lines
                    break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
        return routed if routed.exists() else None

    (tmp_path / "a").mkdir()
    (tmp_path / "ta").mkdir()
    routed = run("gds_persist", tmp_path / "a", tmp_path / "ta")
    assert not (tmp_path / "a" / "cufile.log").exists()
    if routed is None:
        pytest.skip("libcufile wrote no log at all in this environment (nothing to redirect)")
    assert routed.stat().st_size > 0
    (tmp_path / "b").mkdir()
    (tmp_path / "tb").mkdir()
    run("plain", tmp_path / "b", tmp_path / "tb")
    assert (tmp_path / "b" / "cufile.log").exists()  # control: the problem is real


def _fresh_python(code: str) -> None:
    """``code`` in a fresh interpreter (what it imports is what is checked), this checkout's
    gds_persist first on the path."""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def test_import_does_not_touch_the_gpu_stack():
    _fresh_python("import sys, gds_persist, gds_persist.parallel.topology, "
                  "gds_persist.transfer.device_crc, gds_persist.transfer.cuda_copy\n"
                  "bad = [m for m in ('kvikio', 'cupy') if m in sys.modules]\n"
                  "assert not bad, bad\n")


# --- side-stream copies (CPU behaviour) ------------------------------------------------------

def test_copier_only_for_cuda_tensors():
    cpu = [torch.zeros(3), torch.ones(2)]
    assert copier_for(cpu) is None
    c = StreamCopier()
    dst = torch.zeros(5)
    c.copy(dst, torch.arange(5.0))  # CPU tensors: a plain synchronous copy
    c.wait()
    assert torch.equal(dst, torch.arange(5.0))


# --- topology ----------------------------------------------------------------------------------

def test_topology_never_raises_and_says_no_nvml():
    t = topology()
    assert isinstance(t, Topology)
    if not t.nvml:
        assert t.reason.startswith("no NVML")
        assert t.gpus == ()
        assert t.summary().startswith("no GPU (no NVML")
    else:
        assert t.reason.startswith("NVML")
    d = t.as_dict()
    assert d["nvml"] == t.nvml and isinstance(d["gpus"], list | tuple)


def test_topology_defaults_without_nvml():
    t = topology()
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    if not t.nvml:
        assert cpus_near(0, t) == allowed
        assert cpus_near(99, t) == allowed
        assert bind_current_thread_near(0, t) == allowed
    assert cpus_near(12345, Topology(False, "no NVML: test")) == allowed


def test_topology_without_nvidia_ml_py_installed():
    """As if nvidia-ml-py were not installed (its import blocked): still a clean answer."""
    _fresh_python("import sys; sys.modules['pynvml'] = None\n"
                  "from gds_persist.parallel.topology import topology\n"
                  "t = topology(); print(t.reason)\n"
                  "assert not t.nvml and 'nvidia-ml-py not importable' in t.reason\n")


# --- on a GPU ------------------------------------------------------------------------------------

def _cuda_or_skip():
    if not CUDA:
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")


@pytest.mark.gpu
def test_gpu_topology_reports_the_gpu():
    _cuda_or_skip()
    t = topology()
    assert t.nvml, t.reason
    assert len(t.gpus) >= 1 and t.gpus[0].name and t.driver
    assert t.gpus[0].memory_bytes > 0


@pytest.fixture
def shm_path():
    """A fresh directory on tmpfs: files there are not preallocated, so each ends where its
    writes end (a short tail shows up as a truncated file)."""
    if not os.path.isdir("/dev/shm") or not memory_backed("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="gds_persist-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.parametrize("place", ["disk", "tmpfs"])
@pytest.mark.parametrize("backend", ["kvikio", "direct"])
def test_gpu_round_trip_identical_files(request, backend, place):
    """CUDA tensors through kvikio (GDS or compat) and through the pinned D2H pipeline: same
    files as the CPU path, on the disk and on tmpfs (no preallocation: the file's aligned end is
    the writer's to make); loads back on the GPU (device-side verify) and on the CPU."""
    _cuda_or_skip()
    tmp_path = request.getfixturevalue("tmp_path" if place == "disk" else "shm_path")
    if backend == "kvikio":
        _kvikio_or_skip()
    sd = _state_dict("cuda")
    with gds_persist.settings.set(block_bytes=1 << 20, staging_bytes=2 << 20):  # many buffers
        info = gds_persist.save(sd, tmp_path / "gpu", backend=backend)
    if backend == "kvikio":
        assert info.backend == "kvikio", info.reason
    gds_persist.save({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in sd.items()},
                     tmp_path / "cpu", backend="direct")
    assert _data_files(tmp_path / "gpu") == _data_files(tmp_path / "cpu")
    on_gpu = gds_persist.load(tmp_path / "gpu", backend=backend)
    on_cpu = gds_persist.load(tmp_path / "gpu", map_location="cpu")
    for k in ("w", "b", "tiny", "empty"):
        assert on_gpu[k].is_cuda and torch.equal(on_gpu[k], sd[k])
        assert torch.equal(on_cpu[k], sd[k].cpu())


@pytest.mark.gpu
def test_gpu_device_verify_catches_a_flipped_byte(tmp_path):
    _cuda_or_skip()
    _kvikio_or_skip()
    gds_persist.save(_state_dict("cuda"), tmp_path / "ck", backend="kvikio")
    data = next((tmp_path / "ck").glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(gds_persist.ChecksumError, match=r"tensor \['w'\].*offset 0"):
        gds_persist.load(tmp_path / "ck", backend="kvikio")


@pytest.mark.gpu
def test_gpu_kvikio_runtime_failure_falls_back_mid_save(tmp_path):
    """A real cuFile error at run time (a write through a CuFile opened read-only: EBADF)
    switches the backend to bounce-buffer POSIX I/O, and the bytes still land."""
    _cuda_or_skip()
    kb = _kvikio_or_skip()
    be = kb.KvikioBackend()
    ok, why = be.probe(str(tmp_path))
    assert ok, why
    path = str(tmp_path / "f.bin")
    t = torch.randint(0, 256, (3 * 4096 + 17,), dtype=torch.uint8, device="cuda")
    h = be.open(path, write=True, size=4 * 4096)
    try:
        h.cufile.close()
        import kvikio

        h.cufile = kvikio.CuFile(path, "r")  # writes through it fail for real
        be.pwrite(h, t, 0)
        be.sync(h)
    finally:
        be.close(h)
    assert be.fallback_reason and "fell back" in be.fallback_reason
    assert not be.accepts_device
    assert Path(path).read_bytes()[: t.numel()] == t.cpu().numpy().tobytes()


@pytest.mark.gpu
def test_gpu_side_stream_copies_do_not_block_the_current_stream():
    """The copier's stream waits on the current stream, not the other way round: the copies
    see data produced before they were queued."""
    _cuda_or_skip()
    src = torch.zeros(1 << 24, dtype=torch.uint8, device="cuda")
    src.add_(7)  # queued on the current stream
    c = StreamCopier()
    from gds_persist.backends.buffers import AlignedBuffer

    with AlignedBuffer(1 << 24) as host:
        c.copy(host.tensor, src)
        c.wait()
        assert bool((host.tensor == 7).all())
