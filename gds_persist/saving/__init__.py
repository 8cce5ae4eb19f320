"""Saving: one save sequence, and a layout per way of saving.

* :mod:`.save`: ``save``, the entry point; :mod:`.options`: its arguments as one checked record;
* :mod:`.sequence`: the one sequence every save runs (prepare, plan, begin, write, seal, commit;
  alone or with a process group), and the :class:`~.sequence.Layout` interface;
* :mod:`.directory`: the directory format's layout (plain or units, one process or data-parallel,
  rank-local parts), with :mod:`.stripes` (its data directories) and :mod:`.units` (version-4
  units); :mod:`.torch_file`: one ``torch.save`` file, by one process or many;
* :mod:`.manifest_builder`: the one place a manifest is put together;
* :mod:`.as_saved`: the seal's check that the written bytes are the state at ``save``;
* :mod:`.incremental`: the base checkpoint and references to it (``base=``);
* :mod:`.compression`: ``compression=`` - whether units are stored encoded, and why.

Every save ends in the commit of :mod:`gds_persist.transfer.commit`.
"""
