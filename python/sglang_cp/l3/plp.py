"""Probe whether the block device under a path reports a volatile write cache.

Linux exposes `/sys/block/<dev>/queue/write_cache`: "write back" means the device acknowledges writes
held in a volatile cache (no power-loss protection assumed), "write through" means it does not. The
probe follows the filesystem's st_dev to the disk (a partition resolves to its parent disk).
"""

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PlpProbe:
    path: str
    device: Optional[str]      # e.g. "vda"; None when the path is not on a block device (tmpfs, overlay)
    write_cache: Optional[str]  # raw sysfs value, None when unknown

    @property
    def volatile(self) -> bool:
        return self.write_cache is not None and self.write_cache.strip() == "write back"


def _disk_dir_for(dev_t: int, sys_root: str) -> Optional[str]:
    link = os.path.join(sys_root, "dev", "block", f"{os.major(dev_t)}:{os.minor(dev_t)}")
    if not os.path.exists(link):
        return None
    real = os.path.realpath(link)
    # A partition's sysfs dir has a "partition" file and lives inside its disk's dir.
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return real


def probe_write_cache(path: str, sys_root: str = "/sys") -> PlpProbe:
    """Never raises: an unknown answer is reported as device/write_cache None."""
    try:
        disk_dir = _disk_dir_for(os.stat(path).st_dev, sys_root)
    except OSError:
        return PlpProbe(path, None, None)
    if disk_dir is None:
        return PlpProbe(path, None, None)
    try:
        with open(os.path.join(disk_dir, "queue", "write_cache")) as f:
            value = f.read().strip()
    except OSError:
        value = None
    return PlpProbe(path, os.path.basename(disk_dir), value)
