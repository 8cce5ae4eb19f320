"""Which filesystem a device number names, from ``/proc/self/mountinfo``: a name that outlives a
remount (the device numbers of tmpfs and other anonymous filesystems are handed out again)."""

from __future__ import annotations

import os


def filesystem_key(dev: int) -> str:
    """``"<type> <source> <mount point>"`` of the filesystem of device number ``dev`` (the first
    mount of it), or ``"device <major>:<minor>"`` where the mount table does not say."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                ids, _, rest = line.partition(" - ")
                fields, tail = ids.split(), rest.split()
                if len(fields) >= 5 and len(tail) >= 2 and fields[2] == wanted:
                    return f"{tail[0]} {tail[1]} {fields[4]}"
    except OSError:
        pass
    return f"device {wanted}"
