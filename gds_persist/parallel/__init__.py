"""The data-parallel glue: who writes and reads which bytes, and moving bytes between ranks.

* :mod:`.distributed`: the only module that calls ``torch.distributed`` (``Comm``; ``SoloComm``
  without a group), every collective bounded by ``collective_timeout_s``;
* :mod:`.topology`: the node and GPU affinity of this process (NVML);
* :mod:`.schedule`: which rank writes which byte ranges into which file, and which rank reads
  what in a shared load (pure data, tested for 1..1024 ranks without processes);
* :mod:`.balancing`: byte-range balancing of DCP write items (pure data);
* :mod:`.replicas`: the check that the replicated state is the same on every rank;
* :mod:`.shared_reads`: the replicated extents cut into per-rank pieces, and their CRC32C joined
  back per extent;
* :mod:`.exchange`: the bytes of a shared read moved to every rank (broadcast / all-gather).
"""
