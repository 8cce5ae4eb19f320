"""The Checkpointer's node-memory tier (``memory_root=``, docs/RECOVERY.md).

* :mod:`.memory`: one rank's view of its node's tmpfs directory: layout, room, retention;
* :mod:`.shares`: a step's commit, each rank its byte-range share of the replicated state;
* :mod:`.replicate`: who keeps whose shares (pure data), and copying share directories between
  ranks over the process group;
* :mod:`.reading`: the restore of one step from the shares each node holds, the missing ones
  sent point to point, and the healing of the copies a node lacked;
* :mod:`.recovery`: which step, which copy of each share (the holdings), else the drive.

When a step goes to the tier, and the writes there, are the Checkpointer's
(:mod:`gds_persist.training.tiers`).
"""
