"""Checkpointing that overlaps training: the :class:`~gds_persist.Checkpointer` (docs/TRAINING.md)
and the node-memory tier (docs/RECOVERY.md).

* :mod:`.checkpointer`: the ``Checkpointer`` itself, its public API and what joins the parts;
* :mod:`.handles`: ``SaveHandle``, the counters (``CheckpointerStats``), the saves in flight and
  every bounded wait on them;
* :mod:`.streams`: the CUDA events recorded at ``save`` and the side streams the copies run on;
* :mod:`.tiers`: where each step goes (memory, drive) and how: incremental bases, publishing;
* :mod:`.snapshot`: bounded host snapshots in one (pinned, or shared) arena, and its owner;
* :mod:`.background_writer`: the one background writer (a thread per stage, in order; a dead
  one's work failed and the thread replaced; the first error raised, the later ones noted), of
  the Checkpointer and of the trainer integrations;
* :mod:`.helper` (with :mod:`._helper_main`): ``writer="process"``'s helper process;
* :mod:`.mode`: ``mode="auto"``'s rule (a pure function);
* :mod:`.steps`: the layout of a root: step directories, ``latest``, retention;
* :mod:`.optimizer_state`: ``init_optimizer_state``, for a restore fully in place;
* :mod:`.tier`: the memory tier: its layout and room, the replicas, the restore.
"""
