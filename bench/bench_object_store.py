"""Saves and loads to an object store (s3://) beside the clients' own transfers of the same
bytes, on one local S3-compatible server (moto's, started by bench/s3_server.py), in one run.

Methods, each a median of ``--runs`` passes, interleaved ABBA (the order reversed every other
pass: other processes share these CPUs, and the server keeps what it holds in memory):

* ``gds_persist`` save / load (fresh tensors) / load into= of a state of ``--mib`` MiB;
* ``boto3``: s3transfer's own bulk upload (``upload_fileobj``, multipart) and ranged parallel
  download (``download_fileobj``) of the same bytes, same part size and concurrency;
* ``obstore``: ``put`` (multipart) and ``get_range`` of each 16 MiB range from as many threads
  (the Rust client); also ``get_ranges``, which merges adjacent ranges into one GET;
* ``s3torchconnector``: its DCP ``S3StorageWriter`` / ``S3StorageReader`` with
  ``torch.distributed.checkpoint`` where it installs and can talk to the server (else the
  reason is recorded).

    python -m bench.bench_object_store --mib 256 --runs 5 --out bench/results/x.json

The object store holds the bytes in the server's memory: there is no disk/tmpfs distinction on
the store side (the figures include no fsync: an object store's PUT is durable when it
answers). What limits every method here is the server process (Python) on the same 2 CPUs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench.s3_server import S3Server

MiB = 1 << 20
PART = 16 * MiB


class _ViewWriter(io.RawIOBase):
    """A preallocated buffer as a seekable file (the download's destination, no growth)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = (0, self.pos, len(self.view))[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        self.view[self.pos: self.pos + n] = memoryview(b).cast("B")
        self.pos += n
        return n


def _state(mib: int) -> dict[str, Any]:
    """Eight tensors of ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(mib * MiB // 32, generator=g) for i in range(8)}


def _flat_bytes(state: dict[str, Any]) -> memoryview:
    return memoryview(torch.cat([t.view(torch.uint8) for t in state.values()]).numpy())


def methods(s3: S3Server, state: dict[str, Any], threads: int) -> dict[str, Callable[[], Any]]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    import gds_persist

    data = _flat_bytes(state)
    n = len(data)
    client = boto3.client("s3")
    tc = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=PART,
                        max_concurrency=threads)
    sink = memoryview(bytearray(n))
    into = {k: torch.empty_like(v) for k, v in state.items()}
    out: dict[str, Callable[[], Any]] = {
        "gds_persist save": lambda: gds_persist.save(state, "s3://bench/gds"),
        "gds_persist load": lambda: gds_persist.load("s3://bench/gds"),
        "gds_persist load into=": lambda: gds_persist.load("s3://bench/gds", into=into),
        "boto3 upload_fileobj": lambda: client.upload_fileobj(
            io.BytesIO(data), "bench", "raw/boto3", Config=tc),
        "boto3 download_fileobj": lambda: client.download_fileobj(
            "bench", "raw/boto3", _ViewWriter(sink), Config=tc),
    }
    try:
        import obstore
        from obstore.store import S3Store

        store = S3Store("bench", endpoint=s3.endpoint, region="us-east-1",
                        access_key_id="testing", secret_access_key="testing",
                        client_options={"allow_http": True})
        starts = list(range(0, n, PART))
        ends = [min(s + PART, n) for s in starts]
        out["obstore put"] = lambda: obstore.put(store, "raw/obstore", data, chunk_size=PART,
                                                 max_concurrency=threads)
        # get_ranges merges adjacent ranges into one GET of the whole object (coalesce=0 too),
        # which moto answers at a fraction of the cost of 16 MiB ranges (it reads the whole
        # object for each ranged GET); get_range from as many threads sends the same requests
        # as the others
        out["obstore get_ranges (one merged GET)"] = lambda: obstore.get_ranges(
            store, "raw/obstore", starts=starts, ends=ends, coalesce=0)
        out["obstore get_range"] = lambda: _in_threads(
            threads, [lambda s=s: obstore.get_range(store, "raw/obstore", start=s, length=min(
                PART, n - s)) for s in starts])
    except ImportError as e:
        out["obstore (not installed)"] = _why(e)
    out.update(_s3torch(state, into))
    return out


def _in_threads(threads: int, calls: list[Callable[[], Any]]) -> None:
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(c) for c in calls]:
            f.result()


def _why(e: BaseException) -> Callable[[], Any]:
    def fail() -> Any:
        raise RuntimeError(f"{type(e).__name__}: {e}")
    return fail


def _s3torch(state: dict[str, Any], into: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    try:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError as e:
        return {"s3torchconnector DCP (not installed)": _why(e)}
    cfg = S3ClientConfig(force_path_style=True)  # endpoint: AWS_ENDPOINT_URL (the CRT reads it)
    return {
        "s3torchconnector DCP save": lambda: dcp.save(state, storage_writer=S3StorageWriter(
            "us-east-1", "s3://bench/s3torch", s3client_config=cfg), no_dist=True),
        "s3torchconnector DCP load": lambda: dcp.load(into, storage_reader=S3StorageReader(
            "us-east-1", "s3://bench/s3torch", s3client_config=cfg), no_dist=True),
    }


def measure(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    errors: dict[str, str] = {}
    names = list(fns)
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:  # ABBA
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                fns[name]()
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - recorded: why a peer did not run (DCP's
                # CheckpointException is a BaseException)
                errors[name] = f"{type(e).__name__}: {e}"[:400]
                continue
            times[name].append(time.perf_counter() - t0)
    return {"times_s": {k: v for k, v in times.items() if v}, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--methods", default="", help="comma-separated parts of method names to "
                    "run (default: all)")
    args = ap.parse_args()
    from gds_persist import settings

    threads = settings.current().io_threads
    with S3Server("bench") as s3:
        os.environ.update(s3.env)
        state = _state(args.mib)
        nbytes = sum(t.nbytes for t in state.values())
        fns = methods(s3, state, threads)
        if args.methods:
            wanted = [w.strip() for w in args.methods.split(",")]
            fns = {k: v for k, v in fns.items() if any(w in k for w in wanted)}
        got = measure(fns, args.runs)
    med = {k: statistics.median(v) for k, v in got["times_s"].items()}
    rate = {k: nbytes / v / 1e9 for k, v in med.items()}
    ratios = {}
    for ours, theirs in (("gds_persist save", "boto3 upload_fileobj"),
                         ("gds_persist load", "boto3 download_fileobj"),
                         ("gds_persist load into=", "boto3 download_fileobj"),
                         ("gds_persist save", "obstore put"),
                         ("gds_persist load", "obstore get_range"),
                         ("gds_persist load", "obstore get_ranges (one merged GET)")):
        if ours in rate and theirs in rate:
            ratios[f"{ours} / {theirs}"] = rate[ours] / rate[theirs]
    result = {"bytes": nbytes, "runs": args.runs, "io_threads": threads, "part_bytes": PART,
              "median_s": med, "GBps": rate, "ratios": ratios, **got,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    for k, v in sorted(rate.items()):
        print(f"{k:<30} {v:6.3f} GB/s  (median of {len(got['times_s'][k])})")
    for k, v in ratios.items():
        print(f"{k:<60} {v:5.2f}x")
    for k, v in got["errors"].items():
        print(f"{k}: did not run: {v}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
