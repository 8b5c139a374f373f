"""Which block device a directory's I/O lands on, to tell when two [[disks]] entries share one.

Two paths on one filesystem share its ``st_dev``. Below that, sysfs tells which disk serves a device:
a partition belongs to its disk (``/sys/block/<disk>/<part>``), a device-mapper or md device with a
single member sits on that member (``slaves/``), and a loop device on its backing file, whose own
filesystem is resolved the same way. So two loop-mounted image files on one disk resolve to that disk.
Not resolved (the chain stops there): devices with several members (RAID, striped LVM), network and
FUSE filesystems, tmpfs (no block device at all).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

_MAX_DEPTH = 8  # loop on a file on a loop on ...: a bound, not a real limit


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def disk_chain(path: str, sys_root: str = "/sys", _depth: int = 0) -> tuple[str, ...]:
    """The block devices a path's I/O goes through, top to bottom, ending at the disk that serves it:
    ``("vda",)``, ``("loop3", "vda")``, ``("dm-0", "nvme0n1")``. ``()`` when sysfs does not say (tmpfs,
    overlay, no /sys, the path is gone). Never raises."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return ()
    link = os.path.join(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    if not os.path.exists(link):
        return ()
    real = os.path.realpath(link)
    chain: list[str] = []
    for _ in range(_MAX_DEPTH):
        if os.path.exists(os.path.join(real, "partition")):
            real = os.path.dirname(real)  # a partition's sysfs dir lives inside its disk's
        chain.append(os.path.basename(real))
        backing = _read(os.path.join(real, "loop", "backing_file"))
        if backing:
            if backing.endswith(" (deleted)"):
                backing = backing[: -len(" (deleted)")]
            below = disk_chain(backing, sys_root, _depth + 1) if _depth < _MAX_DEPTH else ()
            return tuple(chain) + below
        try:
            members = os.listdir(os.path.join(real, "slaves"))
        except OSError:
            members = []
        if len(members) != 1:
            break
        real = os.path.realpath(os.path.join(real, "slaves", members[0]))
    return tuple(chain)


def shared_device(a: str, b: str, sys_root: str = "/sys") -> Optional[str]:
    """Why paths a and b put their I/O on one device, in words; None when they do not (or sysfs cannot
    tell). Same st_dev: one filesystem. Same last element of ``disk_chain``: one disk underneath."""
    try:
        da, db = os.stat(a).st_dev, os.stat(b).st_dev
    except OSError:
        return None
    if da == db:
        name = disk_chain(a, sys_root)
        on = f" on {name[-1]}" if name else ""
        return f"the same filesystem (device {os.major(da)}:{os.minor(da)}{on})"
    ca, cb = disk_chain(a, sys_root), disk_chain(b, sys_root)
    if ca and cb and ca[-1] == cb[-1]:
        return f"the same disk {ca[-1]} (through {' -> '.join(ca)} and {' -> '.join(cb)})"
    return None


def shared_device_pairs(paths: Sequence[str], sys_root: str = "/sys") -> list[tuple[int, int, str]]:
    """(i, j, why) for every pair of paths (i < j) whose I/O lands on one device."""
    out = []
    for i in range(len(paths)):
        for j in range(i + 1, len(paths)):
            why = shared_device(paths[i], paths[j], sys_root)
            if why:
                out.append((i, j, why))
    return out
