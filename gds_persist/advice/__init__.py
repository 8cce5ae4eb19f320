"""Advice: how often to checkpoint, what a drive endures, how a save scales. Pure arithmetic, no
I/O, no processes (``gds-persist advise`` and ``gds-persist plan`` print it).

* :mod:`.interval`: Young's and Daly's interval from a measured checkpoint cost and the MTBF;
* :mod:`.levels`: per level, ``memory_every`` and ``drive_every`` (Benoit et al.'s model);
* :mod:`.multilevel`: every level's interval, node-local levels and the durable one;
* :mod:`.wear`: the drive writes per day against its rated endurance (TBW, DWPD);
* :mod:`.scale`: the data-parallel save at scale, through the real scheduler;
* :mod:`.units`: durations and byte sizes as people write them.
"""
