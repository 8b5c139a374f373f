"""The hugetlbfs mount: is it one, what page size, how many hugepages are free.

Free hugepages are read from two places, because neither alone is the truth:

* ``statvfs`` on the mount counts the mount's own pool, but only when it was mounted
  with ``size=``/``nr_inodes``-style limits. Without a limit hugetlbfs reports
  ``f_blocks = f_bavail = 0`` (checked on Linux 6.18 here), so trusting statvfs alone
  would refuse every unlimited mount -- the common ``mount -t hugetlbfs none DIR``.
* sysfs ``/sys/kernel/mm/hugepages/hugepages-<kB>kB/`` counts the kernel-wide pool of
  that page size; ``free_hugepages`` still includes pages reserved by live mappings
  (``resv_hugepages``), so what a new mapping can get is ``free - resv``.

The usable number is the smaller of the two that apply.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Optional

from sglang_cp.l2.errors import NotHugetlbfsError

HUGETLBFS_MAGIC = 0x958458F6
SYSFS_HUGEPAGES = "/sys/kernel/mm/hugepages"
FIX_MOUNT = (
    "mount one with `echo N > /proc/sys/vm/nr_hugepages && mkdir -p {path} && "
    "mount -t hugetlbfs none {path}`, or point --cp-shared-l2-hugetlbfs-dir at an "
    "existing hugetlbfs mount (see /proc/mounts)"
)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def statfs_type(path: str) -> int:
    """``f_type`` of statfs(2); os.statvfs does not expose it."""
    # struct statfs begins with f_type (a long on every 64-bit Linux ABI we run on).
    buf = ctypes.create_string_buffer(512)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def mount_fstype(path: str, proc_mounts: str = "/proc/mounts") -> Optional[str]:
    """Filesystem type of the mount holding ``path``, by longest mount-point prefix."""
    real = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open(proc_mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return None
    return fstype


@dataclass(frozen=True)
class HugepageCapacity:
    mount: str
    hugepage_size: int
    total_pages: Optional[int]  # None: neither statvfs nor sysfs gave a total
    free_pages: int
    source: str  # which counters decided free_pages

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.hugepage_size


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def sysfs_pool(hugepage_size: int, root: str = SYSFS_HUGEPAGES) -> Optional[tuple[int, int]]:
    """(total, available = free - reserved) of the kernel pool of this page size."""
    d = os.path.join(root, f"hugepages-{hugepage_size // 1024}kB")
    total = _read_int(os.path.join(d, "nr_hugepages"))
    free = _read_int(os.path.join(d, "free_hugepages"))
    resv = _read_int(os.path.join(d, "resv_hugepages")) or 0
    if total is None or free is None:
        return None
    return total, max(free - resv, 0)


@dataclass(frozen=True)
class HugetlbfsMount:
    """A directory slab files are created in, with the hugepage size they are made of.

    Production code builds it with :meth:`probe`, which refuses anything that is not a
    hugetlbfs mount. :meth:`for_testing_on` is the one seam that lets a test run the
    same planning/mapping code on an ordinary directory: it must never be reachable
    from a server flag.
    """

    path: str
    hugepage_size: int
    is_hugetlbfs: bool
    sysfs_root: Optional[str] = SYSFS_HUGEPAGES

    @classmethod
    def probe(cls, path: str, sysfs_root: Optional[str] = SYSFS_HUGEPAGES) -> "HugetlbfsMount":
        fix = FIX_MOUNT.format(path=path)
        if not os.path.isdir(path):
            raise NotHugetlbfsError(
                f"--cp-shared-l2-hugetlbfs-dir={path!r} does not exist or is not a directory; {fix}"
            )
        try:
            magic = statfs_type(path)
        except OSError:
            magic = None
        fstype = mount_fstype(path)
        if magic != HUGETLBFS_MAGIC and fstype != "hugetlbfs":
            seen = f"{fstype or 'unknown'} (statfs f_type {magic:#x})" if magic is not None else fstype
            raise NotHugetlbfsError(
                f"--cp-shared-l2-hugetlbfs-dir={path!r} is not a hugetlbfs mount (it is {seen}); "
                f"--enable-cp-shared-physical-l2-hicache never falls back to ordinary memory; {fix}"
            )
        st = os.statvfs(path)
        return cls(path=path, hugepage_size=int(st.f_bsize), is_hugetlbfs=True, sysfs_root=sysfs_root)

    @classmethod
    def for_testing_on(cls, path: str, hugepage_size: int) -> "HugetlbfsMount":
        """Test seam: treat an ordinary directory as a mount of ``hugepage_size`` pages."""
        if hugepage_size <= 0 or hugepage_size & (hugepage_size - 1):
            raise ValueError(f"hugepage_size must be a power of two, got {hugepage_size}")
        return cls(path=path, hugepage_size=hugepage_size, is_hugetlbfs=False, sysfs_root=None)

    def capacity(self) -> HugepageCapacity:
        st = os.statvfs(self.path)
        if not self.is_hugetlbfs:
            # Seam: the directory's free bytes stand in for free hugepages.
            free = st.f_bavail * st.f_frsize // self.hugepage_size
            total = st.f_blocks * st.f_frsize // self.hugepage_size
            return HugepageCapacity(self.path, self.hugepage_size, total, free, "statvfs(test seam)")
        candidates = []
        totals = []
        if st.f_blocks > 0:  # the mount has its own size limit
            candidates.append(("statvfs", int(st.f_bavail)))
            totals.append(int(st.f_blocks))
        pool = sysfs_pool(self.hugepage_size, self.sysfs_root) if self.sysfs_root else None
        if pool is not None:
            candidates.append(("sysfs", pool[1]))
            totals.append(pool[0])
        if not candidates:
            raise NotHugetlbfsError(
                f"cannot tell how many hugepages are free for {self.path!r}: the mount has no "
                f"size= limit and {self.sysfs_root} is unreadable; mount it with "
                f"`-o size=<bytes>` or expose /sys/kernel/mm/hugepages"
            )
        source, free = min(candidates, key=lambda c: c[1])
        return HugepageCapacity(self.path, self.hugepage_size, min(totals), free, source)
