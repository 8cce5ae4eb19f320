"""Moving bytes between tensors and data files, checksumming them on the way, and committing.

* :mod:`.staging`: the bounded ring of aligned (pinned) host buffers and the I/O threads;
* :mod:`.cuda_copy`: device <-> pinned-host copies on a side stream;
* :mod:`.crc` (with :mod:`.device_crc`, the CUDA kernel): CRC32C of host or device bytes;
* :mod:`.pipeline`: what the writer and the reader share;
* :mod:`.writer` / :mod:`.reader`: one data file written / read, CRC32C per extent;
* :mod:`.commit`: temporary directory, fsync, atomic rename.

The backends (:mod:`gds_persist.backends`) sit beside this layer: only they touch file
descriptors of data files. Nothing here knows about state dicts, plans of many files or ranks.
"""
