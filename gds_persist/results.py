"""What the long operations return: plain result records, in one module.

:class:`SaveInfo` (``save``), :class:`DistributedSaveInfo` (``save`` with a process group),
:class:`LoadInfo` (``load(..., return_info=True)``), :class:`VerifyReport` (``verify``),
:class:`ExportInfo` (``export_checkpoint``) and :class:`WarmupReport` (``warmup``). They are plain
dataclasses that pickle (the Checkpointer's helper process sends a ``SaveInfo`` back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ChecksumError


@dataclass
class SaveInfo:
    """What a save did: where, with which backend and why, how many bytes, how long.

    Attributes:
        path: the committed checkpoint (directory or file).
        backend: the I/O backend that wrote it (``"direct"``, ``"buffered"``, ``"kvikio"``).
        reason: why that backend (and, for ``"auto"``, what was measured or missing).
        bytes_written: data file bytes including alignment padding: what hit the drive.
        payload_bytes: tensor bytes.
        seconds: wall time of the save, fsync and commit included; ``gbps`` is
            ``bytes_written / seconds``.
        tensors, storages: how many tensors, and the distinct storages holding them.
        files: the data files written, relative to ``path``.
        referenced_bytes: payload bytes not written because the checkpoint refers to identical
            bytes of ``base`` (format version 4).
        compression, compression_reason: what compression did (``"none"`` / ``"lossless"``)
            and why.
        base: the earlier checkpoint referred to, or None.
    """

    path: str
    backend: str
    reason: str
    bytes_written: int
    payload_bytes: int
    seconds: float
    tensors: int
    storages: int
    files: list[str] = field(default_factory=list)
    referenced_bytes: int = 0
    compression: str = "none"
    compression_reason: str = ""
    base: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds else float("inf")


@dataclass
class DistributedSaveInfo(SaveInfo):
    """:class:`SaveInfo` of a data-parallel save, as seen by one rank: ``bytes_written`` and
    ``gbps`` are for the whole checkpoint (all ranks).

    Attributes:
        rank, world_size: this rank and the group's size.
        writers: the ranks that wrote data files.
        rank_bytes, rank_files, rank_write_seconds: this rank's own writing (``rank_gbps``).
        writer_balance, node_balance: max/mean of the bytes per writer, per node (1.0: even).
        nodes: how many nodes the group spans.
        placement: how writers were chosen, including whether NVML was usable and why not.
        phases: seconds per phase on this rank.
    """

    rank: int = 0
    world_size: int = 1
    writers: list[int] = field(default_factory=list)
    rank_bytes: int = 0
    rank_files: list[str] = field(default_factory=list)
    rank_write_seconds: float = 0.0
    writer_balance: float = 1.0
    node_balance: float = 1.0
    nodes: int = 1
    placement: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def rank_gbps(self) -> float:
        s = self.rank_write_seconds
        return self.rank_bytes / s / 1e9 if s else float("inf")


@dataclass
class LoadInfo:
    """What a load did (``load(..., return_info=True)``): backend(s) and why, bytes, seconds.

    Attributes:
        path: the checkpoint read.
        backend, reason: the backend(s) that read it (comma-separated) and why.
        bytes_read: data file bytes this process read, including alignment padding.
        payload_bytes: tensor bytes returned; ``gbps`` is ``payload_bytes / seconds``.
        seconds: wall time of the load.
        missing_keys: with ``into=`` and ``strict=False``, keys of ``into`` not in the checkpoint.
        unexpected_keys: checkpoint keys not in ``into``, loaded fresh.
        in_place_bytes: bytes read straight into the tensors of ``into``.
    """

    path: str
    backend: str
    reason: str
    bytes_read: int
    payload_bytes: int
    seconds: float
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    in_place_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.payload_bytes / self.seconds / 1e9 if self.seconds else float("inf")


@dataclass
class VerifyReport:
    """What ``verify`` checked, and every checksum mismatch it found."""

    path: str
    files: int
    extents: int
    bytes_checked: int
    errors: list[ChecksumError]
    referenced_bytes: int = 0  # of bytes_checked: held by base checkpoints (format version 4)
    encoded_extents: int = 0  # of extents: stored encoded, checked stored and decoded
    # what the bytes were checked against: "crc32c" (gds_persist's own), "zip crc-32" (a stock
    # torch.save file's), "none" (a file that records no checksums: nothing was checked)
    checksum: str = "crc32c"

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def verified(self) -> bool:
        return self.checksum != "none"


@dataclass
class ExportInfo:
    """What an export wrote."""

    out: str
    to: str
    tensors: int
    bytes_written: int
    notes: list[str]


@dataclass
class WarmupReport:
    """What ``warmup`` did, printable in one line.

    Attributes:
        steps: per step (``cuda``, ``staging``, ``backend``, ``crc_kernel``, ``hash_kernel``)
            its outcome (``"done: ..."``, ``"skipped: why"`` or ``"failed: why"``) and seconds.
        seconds: wall time of the whole warm-up.
        failed: (property) the steps that failed -> why.
    """

    steps: dict[str, tuple[str, float]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> dict[str, str]:
        return {k: v for k, (v, _) in self.steps.items() if v.startswith("failed")}

    def __str__(self) -> str:
        parts = [f"{k} {s:.3f} s: {v}" for k, (v, s) in self.steps.items()]
        return f"warm-up {self.seconds:.3f} s (" + "; ".join(parts) + ")"
