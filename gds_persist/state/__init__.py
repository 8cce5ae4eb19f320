"""Live state dicts: the one walker of what the caller hands to ``save`` and gets from ``load``.

* :mod:`.flatten`: a state dict <-> (tree, tensor records, storages); tied weights stay one
  storage, Python leaves become tree nodes (or pickles, with ``allow_pickle``);
* :mod:`.rank_local`: the rank-local parts of a state dict (ZeRO shards) cut out of the
  replicated rest, with numbered placeholders in its tree.

Nothing here does I/O or knows about files, ranks or backends.
"""
