"""``gds-persist inspect PATH``: what a checkpoint holds, without reading tensor data."""

from __future__ import annotations

import argparse
import json

from ..format import DTYPES, full_tree
from ..format.tree import tensor_paths
from ..load import read_manifest


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list tensors, dtypes, shapes, sizes, extents and checksums")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the validated manifest as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    if args.json:
        from ..format import dump_manifest

        print(json.dumps(json.loads(dump_manifest(m))["body"], indent=1))
        return 0
    w = m.writer
    print(f"checkpoint {args.path}")
    print(
        f"  written by gds_persist {w.get('gds_persist')} on {w.get('host')}, backend "
        f"{w.get('backend')} ({w.get('reason')}), world size {w.get('world_size')}"
    )
    print(
        f"  {len(m.tensors)} tensors in {len(m.storages)} storages, {len(m.files)} data files, "
        f"{m.total_bytes} bytes on disk"
    )
    if m.sections:
        print(f"  rank-local state of ranks {[s.rank for s in m.sections]}")
    for f in m.files:
        where = "" if not f.dir else f" in {m.dirs[f.dir - 1].root}/{m.dirs[f.dir - 1].name}"
        print(f"  file {f.name}{where}: {f.size} bytes")
    extents_of: dict[int, list] = {}
    for e in m.extents:
        extents_of.setdefault(e.storage, []).append(e)
    paths = tensor_paths(full_tree(m))
    print(
        f"  {'key':<48} {'dtype':<14} {'shape':<20} {'bytes':>12}  extents (file@offset+len crc32c)"
    )
    for i, t in enumerate(m.tensors):
        nbytes = DTYPES[t.dtype].itemsize * _numel(t.shape)
        where = ", ".join(
            f"{m.files[e.file].name}@{e.offset}+{e.length} {e.crc32c:08x}"
            for e in extents_of.get(t.storage, [])
        )
        print(
            f"  {paths.get(i, '?'):<48} {t.dtype:<14} {str(list(t.shape)):<20} {nbytes:>12}  "
            f"storage {t.storage}: {where or '(empty)'}"
        )
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
