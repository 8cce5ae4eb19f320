"""The Checkpointer's node-memory tier (``memory_root=``, docs/RECOVERY.md).

* :mod:`.memory`: one rank's view of its node's tmpfs directory: layout, room, commit, retention;
* :mod:`.replicate`: who keeps whose copies (pure data), and copying step directories between
  ranks over the process group;
* :mod:`.recovery`: the restore from the nearest complete, verified copy (own memory, a peer's
  replica, the drive) at the newest step every rank can restore.

When a step goes to the tier, and the writes there, are the Checkpointer's
(:mod:`gds_persist.training.tiers`).
"""
