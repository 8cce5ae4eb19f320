"""The on-disk format: the only code that knows what a checkpoint directory holds.

* :mod:`.records`: the records (dtypes, storages, tensors, data files, extents) and file names;
* :mod:`.tree`: the encoding of a state dict's structure, and the one walker over it;
* :mod:`.leaves`: the extra leaf node kinds of that tree (format version 3);
* :mod:`.manifest`: the manifest, dumped, parsed and validated (spec: ``docs/FORMAT.md``);
* :mod:`.checksum`: CRC32C, the format's checksum, and the algebra that combines it;
* :mod:`.hashing`: BLAKE3-128, the content hash of incremental saves (format version 4);
* :mod:`.codec`: the lossless codec of encoded extents (format version 4).

This module only re-exports them.
"""

from __future__ import annotations

from . import codec, hashing, leaves, tree
from .checksum import crc32c, crc32c_combine, joined_crcs
from .hashing import content_hash
from .manifest import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    REFERENCES_VERSION,
    Manifest,
    base_dir_path,
    canonical,
    data_file_path,
    dump_manifest,
    full_tree,
    local_prefix,
    manifest_storage_keys,
    parse_manifest,
    sections_tree,
    storage_descriptions,
    storage_keys,
)
from .peek import base_names
from .records import (
    ALIGNMENT,
    CODEC_BLOSC2,
    CODEC_NONE,
    CODECS,
    DTYPES,
    MAX_DEPTH,
    SAFE_FILE_NAME,
    STRIPE_MARK,
    BaseRef,
    DataDir,
    DataFile,
    Extent,
    Section,
    StorageRecord,
    TensorRecord,
    align_up,
    data_file_name,
    dtype_name,
    local_file_name,
    rank_data_file_name,
    stripe_dir_name,
)

__all__ = [
    "ALIGNMENT",
    "CHECKSUM_ALGORITHM",
    "CODECS",
    "CODEC_BLOSC2",
    "CODEC_NONE",
    "DTYPES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_DEPTH",
    "READABLE_VERSIONS",
    "REFERENCES_VERSION",
    "SAFE_FILE_NAME",
    "STRIPE_MARK",
    "BaseRef",
    "DataDir",
    "DataFile",
    "Extent",
    "Manifest",
    "Section",
    "StorageRecord",
    "TensorRecord",
    "align_up",
    "base_dir_path",
    "base_names",
    "canonical",
    "codec",
    "content_hash",
    "crc32c",
    "crc32c_combine",
    "joined_crcs",
    "data_file_name",
    "data_file_path",
    "dtype_name",
    "dump_manifest",
    "full_tree",
    "hashing",
    "leaves",
    "local_file_name",
    "local_prefix",
    "manifest_storage_keys",
    "parse_manifest",
    "rank_data_file_name",
    "sections_tree",
    "storage_descriptions",
    "storage_keys",
    "stripe_dir_name",
    "tree",
]
