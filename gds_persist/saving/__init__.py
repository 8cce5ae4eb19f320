"""Saving: the one save orchestrator, alone or with a process group.

* :mod:`.save`: ``save`` - plain (format version 1-3) and version-4 saves on one process;
* :mod:`.options`: ``save``'s keyword arguments as one checked record, passed down;
* :mod:`.data_parallel`: the data-parallel save, phase by phase (``docs/DISTRIBUTED.md``);
* :mod:`.stripes`: its data directories (``data_dirs=``) and what each rank wrote;
* :mod:`.units`: version-4 units, and the write of one directory's files;
* :mod:`.incremental`: the base checkpoint and references to it (``base=``);
* :mod:`.compression`: ``compression=`` - whether units are stored encoded, and why;
* :mod:`.torch_file`: a state dict as one ``torch.save`` file, atomically.

Every save ends in the one commit sequence of :mod:`gds_persist.transfer.commit`.
"""
