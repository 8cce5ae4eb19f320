"""Where the bytes of a load land: fresh storages (a plain ``load``), or the tensors the caller
already holds (``load(into=state)``: a live model's parameters, an optimizer's moments).

The manifest alone decides it, before any byte is read. :func:`match` pairs every tensor of the
checkpoint with the tensor of ``into`` at the same key path and checks shapes and dtypes (every
mismatch in one :class:`StateMismatchError`). :func:`plan_destinations` then gives each checkpoint
storage its byte ranges of destination memory (:class:`Span`):

* **in place**: the storage's tensors are contiguous in the checkpoint and in ``into`` and tile
  the storage exactly (one tensor per storage, as in a model or optimizer state dict): its bytes
  are read straight into the destinations. Reads are cut at tensor boundaries; the CRC32C of the
  pieces is joined back into each extent's before it is compared.
* **through a fresh buffer**: anything else with a destination (a non-contiguous destination, a
  saved view of part of a storage, a storage with tensors that have no destination, an encoded
  extent across tensors): a buffer of the storage, as a plain load allocates, copied into the
  destinations after the read. Extra memory: that storage.
* **fresh**: no destination at all (``strict=False``, or optimizer state before its first step):
  read and returned as a plain load returns it.

Ties: a storage shared by several tensors of the checkpoint fills each destination (copied from
the first where they are separate memory). Destinations sharing memory where the checkpoint holds
separate storages are refused: the checkpoint may hold different values for them.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StateMismatchError
from ..format import Extent, Manifest
from ..format.records import DTYPES, TensorRecord, dtype_name
from ..format.tree import KeyPath, objects_of, path_str, tensor_key_paths
from ..state.flatten import rebuild_tensor

Allocate = Callable[[int], torch.Tensor]  # storage index -> a fresh flat uint8 buffer of it
InPlace = Callable[[Manifest, int, list[torch.Tensor]], bool]  # may storage s land in these?
MapLocation = None | str | torch.device | dict[str, str] | Callable[..., Any]


def target_device(saved: str, map_location: MapLocation, distributed: bool) -> torch.device:
    if distributed and map_location is None and saved.startswith("cuda"):
        return torch.device("cuda", torch.cuda.current_device())  # each rank its own GPU
    if map_location is None or callable(map_location):
        target = saved if map_location is None else "cpu"  # callables see CPU storages first
    elif isinstance(map_location, dict):
        target = map_location.get(saved, saved)
    else:
        target = str(map_location)
    device = torch.device(target)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"the checkpoint holds tensors saved on {saved} but CUDA is not available; pass "
            "map_location='cpu' (or a dict/callable) to load them elsewhere"
        )
    return device


def apply_callable(fn: Callable[..., Any], storage: torch.UntypedStorage, location: str) -> Any:
    result = fn(storage, location)
    if result is None:
        if location == "cpu":
            return storage
        return storage.to(device=target_device(location, None, False))
    return result.untyped() if hasattr(result, "untyped") else result


def tensor_leaves(obj: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, torch.Tensor]]:
    """Every tensor of nested mappings, lists and tuples, with its key path (as the manifest's
    tree spells it); other leaves are skipped: they come from the checkpoint."""
    return objects_of(obj, torch.Tensor, path)


@dataclass
class Matched:
    """The tensors of ``into`` paired with the checkpoint's."""

    dests: dict[int, torch.Tensor]  # checkpoint tensor index -> its destination
    paths: dict[int, str]  # checkpoint tensor index -> its key path, printable
    missing_keys: list[str]  # in ``into``, not in the checkpoint
    unexpected_keys: list[str]  # in the checkpoint, not in ``into`` (loaded fresh)


def match(m: Manifest, tree: Any, into: Any, strict: bool, where: str) -> Matched:
    """Pair the tensors of the checkpoint's ``tree`` with those of ``into`` by key path.

    Raises :class:`StateMismatchError` listing every shape or dtype mismatch, and with
    ``strict`` every missing and unexpected key, before anything is read."""
    given = dict(tensor_leaves(into))
    saved = tensor_key_paths(tree)
    dests: dict[int, torch.Tensor] = {}
    wrong = []
    for i, p in saved.items():
        d = given.get(p)
        if d is None:
            continue
        rec = m.tensors[i]
        if dtype_name(d.dtype) != rec.dtype or tuple(d.shape) != tuple(rec.shape):
            wrong.append(f"{path_str(p)}: saved {rec.dtype} {list(rec.shape)}, given "
                         f"{dtype_name(d.dtype)} {list(d.shape)}")
        else:
            dests[i] = d
    saved_paths = set(saved.values())
    result = Matched(dests, {i: path_str(p) for i, p in saved.items()},
                     [path_str(p) for p in given if p not in saved_paths],
                     [path_str(p) for p in saved.values() if p not in given])
    problems = [f"{len(wrong)} shape/dtype mismatch(es): " + "; ".join(wrong)] if wrong else []
    if strict and result.missing_keys:
        problems.append("missing from the checkpoint: " + ", ".join(result.missing_keys))
    if strict and result.unexpected_keys:
        problems.append("in the checkpoint but not in into=: " + ", ".join(result.unexpected_keys))
    if problems:
        fix = ("give into= tensors of the saved shapes and dtypes" if wrong else
               "pass strict=False to fill the tensors that match and load the rest fresh")
        raise StateMismatchError(f"{where}: into= does not fit the checkpoint: "
                                 + "; ".join(problems) + f". Nothing was read; {fix}")
    return result


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, start + length)`` of a checkpoint storage land in ``buffer`` at ``at``."""

    start: int
    length: int
    buffer: int
    at: int


@dataclass
class Destinations:
    """Where every needed storage of a load lands (see the module docstring)."""

    buffers: list[torch.Tensor] = field(default_factory=list)  # flat uint8 views or fresh
    storage_of: list[int] = field(default_factory=list)  # buffer -> checkpoint storage
    spans: dict[int, list[Span]] = field(default_factory=dict)  # storage -> spans by start
    cuts: dict[int, list[int]] = field(default_factory=dict)  # storage -> tensor boundaries
    fresh: dict[int, int] = field(default_factory=dict)  # storage -> its fresh buffer
    fills: list[tuple[torch.Tensor, TensorRecord]] = field(default_factory=list)
    ties: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dest, src)
    matched: dict[int, torch.Tensor] = field(default_factory=dict)

    def _add(self, storage: int, buffer: torch.Tensor, start: int) -> None:
        self.spans.setdefault(storage, []).append(
            Span(start, buffer.numel(), len(self.buffers), 0))
        self.buffers.append(buffer)
        self.storage_of.append(storage)

    def pieces(self, extents: list[Extent], uniform: bool = False
               ) -> tuple[list[Extent], set[tuple[int, int]]]:
        """``extents`` as the reader reads them: one piece per span an extent overlaps, naming
        the buffer (as its ``storage``) and the place in it. ``uniform``: cut at every tensor
        boundary of the manifest too, so that every rank of a shared load cuts alike whatever
        its destinations. Also returns ``(file, offset)`` of the pieces that are only part of
        an extent: their CRC32C must be joined to the extent's before it is compared."""
        out: list[Extent] = []
        cut: set[tuple[int, int]] = set()
        starts = {s: [span.start for span in spans] for s, spans in self.spans.items()}
        for e in extents:
            spans = self.spans[e.storage]
            bounds = self.cuts[e.storage] if uniform else []
            lo = e.start
            while lo < e.start + e.length:
                span = spans[bisect.bisect_right(starts[e.storage], lo) - 1]
                hi = min(e.start + e.length, span.start + span.length)
                k = bisect.bisect_right(bounds, lo)
                if k < len(bounds):
                    hi = min(hi, bounds[k])
                whole = (lo, hi) == (e.start, e.start + e.length)
                piece = dataclasses.replace(
                    e, storage=span.buffer, start=span.at + lo - span.start, length=hi - lo,
                    offset=e.offset + lo - e.start, crc32c=e.crc32c if whole else 0)
                if not whole:
                    cut.add((piece.file, piece.offset))
                out.append(piece)
                lo = hi
        return out, cut

    def in_place_bytes(self) -> int:
        """Bytes read straight into destinations (not through a fresh buffer)."""
        fresh = set(self.fresh.values())
        return sum(b.numel() for k, b in enumerate(self.buffers) if k not in fresh)

    def finish(self) -> None:
        """After the read: copy into the destinations filled through a fresh buffer, and into
        the separate destinations of tied tensors."""
        with torch.no_grad():
            for dest, rec in self.fills:
                view = rebuild_tensor(dataclasses.replace(rec, requires_grad=False,
                                                          parameter=False),
                                      self.buffers[self.fresh[rec.storage]].untyped_storage())
                dest.copy_(view)
            for dest, src in self.ties:
                dest.copy_(src)

    def returned(self, m: Manifest, wanted: list[int],
                 storages: list[torch.UntypedStorage | None]) -> list[Any]:
        """The tensors to decode the tree with: the destinations, and fresh tensors for the
        rest (``storages``: by checkpoint storage, those of fresh buffers)."""
        tensors: list[Any] = [None] * len(m.tensors)
        for i in wanted:
            if i in self.matched:
                tensors[i] = self.matched[i]
            else:
                t = m.tensors[i]
                tensors[i] = rebuild_tensor(t, storages[t.storage])  # type: ignore[arg-type]
        return tensors


def plan_destinations(m: Manifest, wanted: list[int], needed: list[int],
                      found: Matched | None, allocate: Allocate,
                      in_place: InPlace | None = None) -> Destinations:
    """Every needed storage's spans: in place where the destinations tile it (and ``in_place``,
    if given, allows it for that storage), else a fresh buffer (module docstring).
    ``found``: what :func:`match` paired (None: a plain load)."""
    matched = found.dests if found is not None else {}
    by_storage: dict[int, list[int]] = {}
    for i in wanted:
        by_storage.setdefault(m.tensors[i].storage, []).append(i)
    encoded = {e.storage for e in m.extents if e.encoded}
    out = Destinations(matched=matched)
    if found is not None:
        _refuse_shared_destinations(m, found)
    for s in needed:
        indices = by_storage.get(s, [])
        out.cuts[s] = _boundaries(m, indices)
        tiles = _tiles(m, s, indices, matched, s in encoded)
        if tiles is not None and in_place is not None and not in_place(
                m, s, [d for _, d in tiles[0]]):
            tiles = None
        if tiles is None:
            out.fresh[s] = len(out.buffers)
            out._add(s, allocate(s), 0)
            out.fills.extend((matched[i], m.tensors[i]) for i in indices if i in matched)
            continue
        primaries, ties = tiles
        for start, dest in primaries:
            out._add(s, _bytes_of(dest), start)
        out.ties.extend(ties)
    return out


def _tiles(m: Manifest, s: int, indices: list[int], matched: dict[int, torch.Tensor],
           encoded: bool) -> tuple[list[tuple[int, torch.Tensor]],
                                   list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """The destinations that tile storage ``s`` exactly, by byte start, and the tied ones to
    copy afterwards; None when they do not (a fresh buffer then)."""
    if not indices or any(i not in matched for i in indices):
        return None
    ranges: dict[int, tuple[int, torch.Tensor]] = {}
    ties = []
    for i in indices:
        rec, dest = m.tensors[i], matched[i]
        start, length = _byte_range(rec)
        if length == 0:
            continue
        if not (contiguous(rec) and dest.is_contiguous()):
            return None
        if start in ranges:
            if ranges[start][0] != length:
                return None
            if not _same_memory(dest, ranges[start][1]):
                ties.append((dest, ranges[start][1]))
            continue
        ranges[start] = (length, dest)
    cursor = 0
    for start in sorted(ranges):
        if start != cursor:
            return None
        cursor += ranges[start][0]
    if cursor != m.storages[s].nbytes or (encoded and len(ranges) > 1):
        return None  # an encoded unit cannot be split between destinations
    return [(start, ranges[start][1]) for start in sorted(ranges)], ties


def _byte_range(rec: TensorRecord) -> tuple[int, int]:
    size = DTYPES[rec.dtype].itemsize
    numel = 1
    for n in rec.shape:
        numel *= n
    return rec.storage_offset * size, numel * size


def _boundaries(m: Manifest, indices: list[int]) -> list[int]:
    """The byte offsets where the storage's tensors begin and end (the same on every rank)."""
    points: set[int] = set()
    for i in indices:
        start, length = _byte_range(m.tensors[i])
        points.update((start, start + length))
    return sorted(points)


def contiguous(rec: TensorRecord) -> bool:
    """Whether a saved tensor is laid out row-major without gaps (any stride on size-1 dims)."""
    expected = 1
    for n, stride in zip(reversed(rec.shape), reversed(rec.stride), strict=True):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (the reader's destination)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr()


def _memory(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, last + 1)`` of its device's memory a tensor touches."""
    elements = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + elements * t.element_size()


def _refuse_shared_destinations(m: Manifest, found: Matched) -> None:
    """Destinations that overlap in memory must come from one storage of the checkpoint."""
    spans = sorted((str(d.device), *_memory(d), i) for i, d in found.dests.items() if d.numel())
    reach: tuple[str, int, int] = ("", 0, -1)  # (device, end, tensor) of the farthest so far
    for device, start, end, i in spans:
        dev, far, j = reach
        if dev == device and start < far and m.tensors[i].storage != m.tensors[j].storage:
            raise StateMismatchError(
                f"load(into=): {found.paths[j]} and {found.paths[i]} share memory in into= (tied) "
                "but the checkpoint holds them as separate tensors, which may differ; untie them "
                "in into=, or load without into= and copy")
        if dev != device or end > far:
            reach = (device, end, i)
