"""Map one pool's slab files back to back at a single hugepage-aligned address.

Upstream indexes a host pool as one tensor, so its slabs must be virtually
contiguous. We reserve the whole range first (PROT_NONE, no backing) and then map
each slab file over its part with MAP_FIXED: one virtual range, several files,
several registrations. Nothing here ever falls back to anonymous memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_mod
import logging
import mmap
import os
import threading
from typing import Optional, Sequence

from sglang_cp.l2.errors import InsufficientHugepagesError
from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_plan import SlabPlan, fmt_gb, fmt_page

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def _mmap(addr: Optional[int], length: int, prot: int, flags: int, fd: int) -> int:
    ptr = _libc.mmap(addr, length, prot, flags, fd, 0)
    if ptr is None or ptr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ptr


class SlabMapping:
    """The slabs of one pool: files, one reservation, and their registration state."""

    def __init__(self, plan: SlabPlan, mount: HugetlbfsMount, paths: Sequence[str]):
        if len(paths) != len(plan.slabs):
            raise ValueError(f"{len(paths)} file names for {len(plan.slabs)} slabs")
        self.plan = plan
        self.mount = mount
        self.paths = list(paths)
        self.base = 0
        self._reserve = (0, 0)
        self._fds: list[int] = []
        self._created: list[str] = []
        self.registered: list[tuple[int, int]] = []  # (ptr, bytes) per registered slab
        self._lock = threading.Lock()
        self.closed = False

    def slab_ranges(self) -> list[tuple[int, int]]:
        """(address, mapped bytes) of every slab: exactly the cudaHostRegister calls."""
        return [(self.base + s.offset, s.mapped_bytes) for s in self.plan.slabs]

    def map(self) -> "SlabMapping":
        hp = self.plan.hugepage_size
        reserve_len = self.plan.mapped_bytes + hp
        raw = _mmap(None, reserve_len, 0,  # PROT_NONE: address space only
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        self._reserve = (raw, reserve_len)
        self.base = -(-raw // hp) * hp
        try:
            for slab, path in zip(self.plan.slabs, self.paths):
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                self._fds.append(fd)
                self._created.append(path)
                os.ftruncate(fd, slab.mapped_bytes)
                try:
                    _mmap(self.base + slab.offset, slab.mapped_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd)
                except OSError as e:
                    if e.errno == errno_mod.ENOMEM:
                        # Preflight passed, so another process took the pages meanwhile.
                        raise InsufficientHugepagesError(
                            f"mmap of HiCache host pool {self.plan.label!r} slab "
                            f"{slab.index + 1}/{len(self.plan.slabs)} ({fmt_gb(slab.mapped_bytes)}, "
                            f"{slab.mapped_bytes // hp} x {fmt_page(hp)} hugepages) on {self.mount.path} "
                            f"failed with ENOMEM after the preflight passed: hugepages were taken "
                            f"concurrently. Fix: raise vm.nr_hugepages or lower --hicache-size / "
                            f"--hicache-ratio"
                        ) from e
                    raise
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Unregister (if needed), unmap, close and unlink. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.registered:
                from sglang_cp.l2.registration import unregister_mapping

                try:
                    unregister_mapping(self)
                except Exception as e:  # e.g. at interpreter exit, after CUDA is gone
                    logger.warning("unregistering L2 slabs of %r failed: %s", self.plan.label, e)
            raw, length = self._reserve
            if raw:
                # One munmap over the reservation also drops every MAP_FIXED slab in it.
                if _libc.munmap(raw, length) != 0:
                    logger.warning("munmap of L2 slabs of %r failed: errno %d", self.plan.label, ctypes.get_errno())
                self._reserve = (0, 0)
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds = []
            for path in self._created:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            self._created = []

    def __repr__(self) -> str:
        return (f"SlabMapping({self.plan.label!r}, {len(self.plan.slabs)} slabs, "
                f"base={self.base:#x}, closed={self.closed})")
