"""Bytes read from and written to the block device that holds a path, from the kernel's own counters
(``/sys/dev/block/<major>:<minor>/stat``, sectors of 512 bytes whatever the device's block size).

What a storage tier's phase took from its disk: an O_DIRECT tier's hits are disk reads, a page-file
tier's may be page-cache copies, and a tier with DRAM of its own (Mooncake's segment, LMCache's L1)
serves some "storage" hits without touching the disk. The counters are the whole device's, so other
work on that disk in the same window counts too.
"""

from __future__ import annotations

import os
from typing import Optional

SECTOR = 512  # the stat file counts 512-byte sectors (Documentation/block/stat.rst)


def counters(path: str) -> Optional[dict]:
    """``{"read": bytes, "written": bytes}`` the device holding ``path`` has moved since boot; None where
    the kernel keeps no such counters for it (tmpfs, overlay, NFS: major number 0; a path that does not
    exist)."""
    try:
        dev = os.stat(path).st_dev
        if os.major(dev) == 0:
            return None
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            fields = f.read().split()
        return {"read": int(fields[2]) * SECTOR, "written": int(fields[6]) * SECTOR}
    except (OSError, ValueError, IndexError):
        return None


def delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}
