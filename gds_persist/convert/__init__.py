"""Move checkpoints between gds_persist and the formats trainers already use.

* :func:`~gds_persist.convert.export.export_checkpoint` writes a gds_persist checkpoint (also one
  written through DCP with :class:`gds_persist.dcp.GdsPersistWriter`) as a ``torch.save`` file or
  a ``.safetensors`` file.
* :func:`~gds_persist.convert.importing.import_checkpoint` turns a ``torch.save`` file or a
  ``.safetensors`` file into a gds_persist checkpoint.
* :func:`~gds_persist.convert.materialize.materialize`: a standalone copy of a checkpoint.

The safetensors format itself (header, dtype codes, what it cannot hold) is
:mod:`gds_persist.convert.safetensors`.

Every CRC32C is verified while exporting, output files appear atomically (temporary sibling,
fsync, rename), and nothing is unpickled except by ``torch.load(weights_only=True)``, which
builds only tensors and plain containers and never runs code from the file.

Memory
------
* safetensors export streams: the header is computed from the manifest alone, then the data is
  read block by block through the staging ring by the reader ``load`` uses (CRC32C checked per
  extent) and written at its final offset. Memory stays at the staging ring (``staging_bytes``),
  except for a storage that holds a non-contiguous view: that storage is read whole (bounded by
  that storage, not the checkpoint) so the view can be made contiguous.
* torch export cannot stream: ``torch.save`` pickles a complete object graph, so the whole state
  dict is loaded into host memory first (as ``torch.save`` itself requires).
* imports map the source file (``mmap``): a zip-format ``torch.save`` file is opened with
  ``torch.load(mmap=True)`` and a safetensors file is mapped directly, so tensor bytes are paged
  in from the file as the writer copies them instead of being read into anonymous memory first.
  Legacy (non-zip) ``torch.save`` files cannot be mapped and are loaded whole.
"""

FORMATS = ("torch", "safetensors")  # what export_checkpoint writes and import_checkpoint reads
