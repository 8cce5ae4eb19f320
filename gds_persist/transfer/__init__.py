"""Moving bytes between tensors and data files, checksumming them on the way, and committing.

* :mod:`.staging`: the bounded ring of aligned (pinned) host buffers and the I/O threads;
* :mod:`.cuda_copy`: device <-> pinned-host copies on a side stream;
* :mod:`.crc` (with :mod:`.device_crc`, the CUDA kernel): CRC32C of host or device bytes;
* :mod:`.hashing` (with :mod:`.device_hash`): BLAKE3-128 content hashes of host or device bytes;
* :mod:`.device_kernels`: what the device kernels share (compile once, launch, switch off);
* :mod:`.segments`: a data file's bytes cut into I/O requests (pure data);
* :mod:`.pipeline`: what the writer and the reader share;
* :mod:`.writer` / :mod:`.reader`: data files written / read, CRC32C per extent;
* :mod:`.unit_writer`: version-4 units, hashed, referred to or written (maybe encoded);
* :mod:`.commit`: the one commit sequence - temporary directory, manifest, fsync, atomic rename;
* :mod:`.atomic_file`: the same for a single file (temporary sibling, fsync, rename);
* :mod:`.locks`: ``flock`` lock files (a live save's owner lock, the commit lock);
* :mod:`.opened`: a checkpoint held open for reading while others may replace it;
* :mod:`.warmup`: the first save's start-up work, done ahead.

It sits on :mod:`gds_persist.backends` (only they touch data files' descriptors) and the format.
Nothing here knows about state dicts, plans of many files or ranks.
"""
