"""``gds-persist inspect PATH``: what a checkpoint holds, without reading tensor data."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

from ...format import DTYPES, Extent, Manifest, full_tree, tree
from ...format.tree import KeyPath, path_str, tensor_paths
from ...loading.load import read_manifest

HELP = ("list tensors (dtypes, shapes, sizes, extents, checksums) and the other leaves "
        "(step, config values); what is referenced in base checkpoints and what is compressed")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the validated manifest as JSON")


def run(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    if args.json:
        from ...format import dump_manifest

        print(json.dumps(json.loads(dump_manifest(m))["body"], indent=1))
        return 0
    w = m.writer
    print(f"checkpoint {args.path}")
    print(
        f"  written by gds_persist {w.get('gds_persist')} on {w.get('host')}, backend "
        f"{w.get('backend')} ({w.get('reason')}), world size {w.get('world_size')}"
    )
    print(
        f"  format version {m.version}; {len(m.tensors)} tensors in {len(m.storages)} storages, "
        f"{len(m.files)} data files, {m.total_bytes} bytes on disk"
    )
    payload = sum(s.nbytes for s in m.storages)
    if m.bases:
        print(f"  incremental: {m.referenced_bytes} of {payload} payload bytes are referenced "
              f"in base checkpoints (siblings): "
              + ", ".join(f"{b.name} (manifest sha256 {b.manifest_sha256[:16]}...)"
                          for b in m.bases))
    encoded = [e for e in m.extents if e.encoded]
    if encoded:
        raw = sum(e.length for e in encoded)
        stored = sum(e.stored for e in encoded)
        print(f"  compression: {len(encoded)} of {len(m.extents)} extents encoded "
              f"({encoded[0].codec}), {raw} bytes stored in {stored} ({raw / stored:.3f}x)")
    reason = (w.get("compression") or {}).get("reason") if isinstance(w.get("compression"),
                                                                      dict) else None
    if reason:
        print(f"  compression choice: {reason}")
    if m.sections:
        print(f"  rank-local state of ranks {[s.rank for s in m.sections]}")
    for f in m.files:
        where = "" if not f.dir else f" in {m.dirs[f.dir - 1].root}/{m.dirs[f.dir - 1].name}"
        if f.base:
            where = f" of base checkpoint {m.bases[f.base - 1].name} (referenced)"
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
        where = ", ".join(_extent_text(m, e) for e in extents_of.get(t.storage, []))
        print(
            f"  {paths.get(i, '?'):<48} {t.dtype:<14} {str(list(t.shape)):<20} {nbytes:>12}  "
            f"storage {t.storage}: {where or '(empty)'}"
        )
    others = list(_other_leaves(full_tree(m)))
    if others:
        print(f"  {'other leaves (not tensors)':<48} value")
        for path, value in others:
            print(f"  {path_str(path):<48} {value}")
    return 0


def _other_leaves(node: object, path: KeyPath = ()) -> Iterator[tuple[KeyPath, str]]:
    """(key path, value as printed) of every leaf that is not a tensor, in tree order; modules'
    ``_metadata`` (version records) left out."""
    k = tree.kind(node)
    if k in tree.SEQUENCES or k in tree.MAPPINGS:
        for key, child in tree.children(node):
            if key != tree.META_KEY:
                yield from _other_leaves(child, tree.child_path(path, key))
    elif k is None:
        text = repr(node)
        yield path, text if len(text) <= 60 else text[:57] + "..."
    elif k == tree.FLOAT:
        yield path, node["v"]  # type: ignore[index]
    elif k not in (tree.TENSOR, tree.LOCAL):
        yield path, f"<{k}>"  # numpy values, bytes, paths, enums, pickles


def _extent_text(m: Manifest, e: Extent) -> str:
    f = m.files[e.file]
    text = f"{f.name}@{e.offset}+{e.length} {e.crc32c:08x}"
    if e.encoded:
        text += f" [{e.codec} {e.stored} stored]"
    if f.base:
        text += f" [referenced: {m.bases[f.base - 1].name}]"
    return text


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
