"""Checkpointing that overlaps training: the :class:`~gds_persist.Checkpointer`
(:mod:`.checkpointer`), its bounded host snapshots (:mod:`.snapshot`), its helper process
(:mod:`.helper`), the layout of its root (:mod:`.steps`), and how often to checkpoint
(:mod:`.interval`: Young/Daly)."""
