"""Checkpointing that overlaps training: the :class:`~gds_persist.Checkpointer`
(:mod:`.checkpointer`), its bounded host snapshots (:mod:`.snapshot`), its helper process
(:mod:`.helper`), the layout of its root (:mod:`.steps`), and how often to checkpoint
(:mod:`.interval`: Young/Daly; :mod:`.levels`: per level, ``memory_every`` and ``drive_every``;
:mod:`.wear`: the drive's endurance; :mod:`.units`: durations and sizes)."""
